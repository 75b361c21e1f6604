"""`train.resume=true` where output_dir holds no checkpoint (vlm_corl/training/run/setup.py `_resume_point`) advises
overrides that, followed literally, start the run: over a run that wrote no checkpoint, train.resume=false
train.overwrite=true (train.resume=auto, advised before, was refused there for the run in the folder); over an
empty folder, train.resume=auto. Each advice is applied as given and the start's claim of the folder checked
(`_resume_or_claim`, before any model loads: the members' weights are absent here)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from cohort_helpers import cohort

from vlm_corl.config import ConfigError, load_config
from vlm_corl.training.run.setup import _resume_or_claim

ROOT = Path(__file__).resolve().parents[1]
ABSENT_WEIGHTS = ROOT / "configs" / "models" / "qwen2.5-vl-7b-instruct"  # config.json only: nothing loads
MAIN = SimpleNamespace(is_main=True)  # the one World field the claim reads: world rank 0 clears the folder


def _advice(path: Path, run_dir: Path) -> list[str]:
    cfg = load_config(path, ["train.resume=true"])
    with pytest.raises(ConfigError) as err:
        _resume_or_claim(cfg, run_dir, MAIN)
    said = str(err.value)
    assert "train.resume=true but" in said and "holds no complete checkpoint" in said
    return re.findall(r"train\.\w+=\w+", said.split("holds no complete checkpoint", 1)[1])


@pytest.mark.parametrize("earlier", ["run_without_checkpoint", "nothing"])
def test_the_advice_of_a_resume_without_a_checkpoint_starts_the_run(tmp_path, earlier):
    run_dir = tmp_path / "run"
    cfg = cohort(tmp_path, [("a", ABSENT_WEIGHTS), ("b", ABSENT_WEIGHTS)])
    path = tmp_path / "cohort.yaml"
    path.write_text(yaml.safe_dump(cfg))
    if earlier == "run_without_checkpoint":  # a run stopped before its first checkpoint
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    advised = _advice(path, run_dir)
    assert advised, "the advice names no override"
    followed = load_config(path, ["train.resume=true", *advised])  # the user's command, with the advice added
    assert _resume_or_claim(followed, run_dir, MAIN) == (None, None)  # a fresh run starts in the folder
    assert not (run_dir / "metrics.jsonl").exists()

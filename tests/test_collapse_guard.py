"""The reproduction of a collapse hidden inside a category, at small size, with the guard on.

A member warm-started on balanced easy-vqa (it answers shapes well, ~0.65) is paired under `ring` with a
frozen peer that answers "circle" to every shape question (it was warm-started so) and yes/no questions
well (~0.9). Labelled by the peer, the member's sampled shape answers slide onto "circle": the detector flags
it inside the shape category within the run, and `train.on_collapse` stops the run (exit 3) naming the member
and the category, rolls back to the last checkpoint before the flag, and keeps the best evaluated model. The
slow suite also runs `stop` and the false-alarm check: the same members, budget and detector under `gt`
raise no flag.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from vlm_corl.commands.train import main
from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import balance_by, load_examples
from vlm_corl.members.member import load_member
from vlm_corl.models.warmstart import Schedule, warm_start
from vlm_corl.training.run.guard import EXIT_STATUS


@pytest.fixture(scope="module")
def pair(tiny_zoo, tmp_path_factory) -> dict:
    """The strong member and the peer constant on shapes (~25 s of warm starts)."""
    out = tmp_path_factory.mktemp("pair")
    examples = load_examples("easyvqa", split="train", limit=6000).examples
    by_type: dict[str, list] = {}
    for e in examples[3000:]:
        by_type.setdefault(e.metadata["question_type"], []).append(e)
    # the peer: yes/no 0.9 and colour as learnt, shapes all "circle" (measured on 90 balanced test questions)
    peer_data = (
        by_type["color"][:100] + [replace(e, answer="circle") for e in by_type["shape"][:200]] + by_type["yes/no"][:200]
    )
    recipes = {
        "strong": ("qwen2_vl", balance_by(examples[:3000], "question_type", 900), 150),
        "peer": ("mllama", peer_data, 80),
    }
    for name, (family, data, steps) in recipes.items():
        torch.manual_seed(0)
        member = load_member(MemberConfig(id=name, model=str(tiny_zoo[family])))
        warm_start(member, data, Schedule(steps=steps, batch_size=16, lr=3e-3, seed=0))
        member.save(out / name)
    return {name: out / name for name in recipes}


def _run(pair, tmp_path, mode: str, on_collapse: str, capsys) -> tuple[int, str, dict]:
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "members": [
            {"id": "strong", "model": str(pair["strong"])},
            {"id": "peer", "model": str(pair["peer"]), "trainable": False},
        ],
        "data": {"train": {"loader": "easyvqa", "skip": 6000, "limit": 2000}, "batch_size": 8},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "reward": {"mode": mode},
        "train": {
            "max_steps": 80,
            "lr": 1e-3,
            "save_every": 10,
            "keep_last": 10,
            "warmup_ratio": 0.0,
            "on_collapse": on_collapse,
        },
        "eval": {"benchmarks": ["easyvqa"], "every": 10, "limit": 30, "keep_best": "easyvqa"},
        # no logging.category_key: "auto" finds easy-vqa's question_type, so the per-category guard is on
        "logging": {"report_to": [], "progress": False},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["--config", str(tmp_path / "c.yaml")])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    return code, capsys.readouterr().err, summary


def test_a_category_collapse_is_flagged_and_the_guard_rolls_back(pair, tmp_path, capsys):
    code, err, summary = _run(pair, tmp_path, "ring", "rollback", capsys)
    assert code == EXIT_STATUS
    stopped = summary["stopped_by_guard"]
    assert stopped["action"] == "rollback" and stopped["warning"]["slot"] == "strong"
    assert stopped["warning"]["category"] == "shape"
    assert "stopped: collapse guard (train.on_collapse=rollback): member 'strong' in category 'shape'" in err
    flag_step = stopped["warning"]["step"]
    assert flag_step < 80  # stopped within the run
    assert stopped["step"] == summary["steps"] == flag_step  # the steps it trained, not train.max_steps
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == flag_step and "category/shape/agreement" in rows[-1]
    assert "category/yes_no/agreement" in rows[-1]  # easy-vqa's yes/no: one level of the key, not two
    evidence = stopped["warning"]  # the late window's shape answers: mostly the peer's "circle", agreed with
    assert evidence["agreement_late"] >= 0.9 > evidence["agreement_early"] and evidence["top_answer_late"] == "circle"
    # the batch rule saw nothing: the collapse hid inside the shape questions
    assert not any("batch" in (r.get("collapse_on") or []) for r in rows)
    # rolled back: the newest checkpoint predates the flag, the later ones are set aside
    checkpoints = tmp_path / "run" / "checkpoints"
    kept = sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*"))
    assert kept and max(kept) < flag_step and summary["checkpoint"].endswith(f"step-{max(kept)}")
    assert all(int(p.name.split("-")[1]) >= flag_step for p in (checkpoints / "collapsed").glob("step-*"))
    # evaluated from step 0 per category; the best model is kept whatever the guard did
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 0 and "accuracy_shape" in evals[0] and "accuracy_yes_no" in evals[0]
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert set(best) == {"strong"} and (tmp_path / "run" / "best" / "strong" / "model.safetensors").is_file()


@pytest.mark.slow
def test_stop_names_the_member_and_a_healthy_gt_run_raises_no_flag(pair, tmp_path, capsys):
    code, err, summary = _run(pair, tmp_path / "ring", "ring", "stop", capsys)
    assert code == EXIT_STATUS and "member 'strong' in category" in err
    assert summary["stopped_by_guard"]["action"] == "stop"
    code, err, summary = _run(pair, tmp_path / "gt", "gt", "stop", capsys)
    assert code == 0 and summary["collapse_warnings"] == [] and summary["stopped_by_guard"] is None

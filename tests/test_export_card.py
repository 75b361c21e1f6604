"""`corl export` writes a model card and prompt_format.json into each member (issue 36, item 4): the card names
the base model, peers, reward, steps, data, the run's evaluations and the prompt format; `corl eval`'s loading
reads the format back, so an export is asked (and scores) as its checkpoint was; the files are 0644."""

from __future__ import annotations

import json
import stat

from cohort_helpers import cohort

from vlm_corl import CohortTrainer
from vlm_corl.config import MemberConfig
from vlm_corl.evaluation.scoring import EASYVQA, benchmark_examples, evaluate_dir, evaluate_member
from vlm_corl.export import main as export
from vlm_corl.members.member import load_member
from vlm_corl.members.prompt_format import member_config


def test_the_export_carries_its_card_and_prompt_format_and_scores_as_the_checkpoint(tiny_zoo, tmp_path, capsys):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward={"mode": "ring"})
    cfg["members"][0].update(prompt_style="boxed", system_prompt="Answer briefly.")  # not the family's default
    cfg["eval"] = {"every": 2, "benchmarks": ["easyvqa"], "limit": 3, "max_new_tokens": 4}
    CohortTrainer(cfg).train()
    assert export([str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    assert "q: model + model card" in capsys.readouterr().out
    q = tmp_path / "export" / "q"
    card = (q / "README.md").read_text()
    said = [f"`{tiny_zoo['qwen2_vl']}`", f"peers: `l` ({tiny_zoo['mllama']})", "**Reward**: `ring`", "**Steps**: 2"]
    said += ["loader `easyvqa`", "| easyvqa | 2 |", "within \\boxed{}", '"Answer briefly."']
    for text in said:
        assert text in card, text
    fmt = json.loads((q / "prompt_format.json").read_text())
    assert fmt["prompt_style"] == "boxed" and fmt["system_prompt"] == "Answer briefly."
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in q.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    # read back: the export is asked as the checkpoint was, and answers the same
    asked = member_config(q)
    assert (asked.prompt_style, asked.system_prompt) == ("boxed", "Answer briefly.")
    examples = benchmark_examples(EASYVQA, 4)
    checkpoint = MemberConfig(id="q", model=str(tmp_path / "run" / "checkpoints" / "step-2" / "q"), trainable=False,
                              prompt_style="boxed", system_prompt="Answer briefly.")  # fmt: skip
    before = evaluate_member(load_member(checkpoint, device=None), examples, EASYVQA)
    after = evaluate_dir(q, EASYVQA, examples)
    assert [r["response"] for r in after["records"]] == [r["response"] for r in before["records"]]
    assert after["accuracy"] == before["accuracy"]
    # the family's default format (no prompt_format.json) asks differently
    assert member_config(tiny_zoo["qwen2_vl"]).prompt_style is None

"""A resume never silently mixes two configs: every schema field has a rule (may it change at resume?), the
table in docs/reliability.md is the rules', and a forbidden change is refused naming the field, its value in the
checkpoint and the new one (exit 2 through `train`), while a free one resumes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cohort_helpers import cohort

from vlm_corl.config import CohortConfig, ConfigError, config_from_dict
from vlm_corl.config.parse import _walk
from vlm_corl.config.resume_rules import RULES, changed_at_resume, markdown_table, rule_for
from vlm_corl.training.loop import run_cohort

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_field_has_a_resume_rule():
    """A new field without a row fails here: decide whether it may change at resume, and why."""
    fields = [p for p, _, tp in _walk(CohortConfig) if not dataclasses.is_dataclass(tp)]
    assert [p for p in fields if rule_for(p) is None] == []
    stale = [p for p in RULES if p not in fields and p not in ("eval", "logging")]
    assert stale == []


def test_the_reliability_page_holds_the_rules_table():
    text = (ROOT / "docs" / "reliability.md").read_text()
    assert markdown_table() in text, "paste `python -m vlm_corl.config.resume_rules` into docs/reliability.md"


def test_changed_fields_are_found_per_member_by_id_and_deepspeed_fixes_the_ranks():
    saved = {"seed": 1, "members": [{"id": "a", "lora": {"r": 4}, "ranks": [0]}], "train": {"lr": 1e-3}}
    new = {"seed": 1, "members": [{"id": "a", "lora": {"r": 8}, "ranks": [1]}], "train": {"lr": 1e-3}}
    assert [(p, o, n) for p, o, n, _ in changed_at_resume(saved, new)] == [("members[0].lora", {"r": 4}, {"r": 8})]
    new["train"].update(lr=2e-3, deepspeed="zero2.json")
    saved["train"]["deepspeed"] = "zero2.json"
    assert {p for p, *_ in changed_at_resume(saved, new)} == {"members[0].lora", "members[0].ranks", "train.lr"}
    other = {**new, "members": [{"id": "b"}]}
    assert changed_at_resume(saved, other)[0][:3] == ("members", ["a"], ["b"])


@pytest.fixture(scope="module")
def saved_run(tiny_zoo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_rules")
    cfg = cohort(tmp, [("a", tiny_zoo["qwen3"]), ("b", tiny_zoo["llama"])], reward={"mode": "ring"})
    cfg["data"] = {"train": {"loader": "math500", "split": "test", "limit": 16}, "batch_size": 2}
    cfg["members"][0]["lora"] = {"r": 4, "alpha": 8.0}
    cfg["train"].update(max_steps=1, save_every=1)
    run_cohort(config_from_dict(cfg))
    return cfg


@pytest.mark.parametrize(
    "change, field, old, new",
    [
        (lambda c: c["members"][0]["lora"].update(r=8), "members[0].lora", "'r': 4", "'r': 8"),
        (lambda c: c["members"][0].pop("lora"), "members[0].lora", "'r': 4", "None"),
        (lambda c: c["train"].update(lr=5e-4), "train.lr", "0.001", "0.0005"),
        (lambda c: c["members"][1].update(model=c["members"][0]["model"]), "members[1].model", "llama", "qwen3"),
    ],
)
def test_a_forbidden_change_is_refused_naming_the_field_and_both_values(saved_run, change, field, old, new):
    cfg = {**saved_run, "train": {**saved_run["train"], "resume": True, "max_steps": 2}}
    cfg["members"] = [dict(m, lora=dict(m["lora"])) if "lora" in m else dict(m) for m in saved_run["members"]]
    change(cfg)
    with pytest.raises(ConfigError) as err:
        run_cohort(config_from_dict(cfg))
    (problem,) = err.value.problems
    assert problem.startswith(f"{field} changed since ") and "checkpoints/step-" in problem
    there, now = problem.split(" there, ")
    assert old in there and new in now.split(" now)")[0]


def test_a_free_change_resumes(saved_run):
    cfg = {**saved_run, "train": {**saved_run["train"], "resume": True, "max_steps": 2, "grad_clip": 0.5}}
    cfg["rollout"] = {**saved_run.get("rollout", {}), "temperature": 0.7}
    assert run_cohort(config_from_dict(cfg))["checkpoint"].endswith("step-2")

"""docs/python-api.md's examples run as written (issue 35): in a folder where `make demo`'s base models are tiny
zoo members and configs/cohorts/tiny_easyvqa.yaml is a small cohort of them."""

from __future__ import annotations

import re

import pytest
import yaml
from cohort_helpers import ROOT, cohort, metrics

EXAMPLES = re.findall(r"### (.+?)\n\n```python\n(.*?)```", (ROOT / "docs" / "python-api.md").read_text(), re.S)


@pytest.fixture
def demo_folder(tiny_zoo, tmp_path, monkeypatch):
    base = tmp_path / "out" / "demo" / "base"
    base.mkdir(parents=True)
    (base / "qwen2_vl").symlink_to(tiny_zoo["qwen2_vl"])
    (base / "qwen2_vl_b").symlink_to(tiny_zoo["mllama"])
    cfg = cohort(tmp_path, [("qwen", base / "qwen2_vl"), ("llama", base / "qwen2_vl_b")], reward={"mode": "ring"})
    (tmp_path / "configs" / "cohorts").mkdir(parents=True)
    (tmp_path / "configs" / "cohorts" / "tiny_easyvqa.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(title: str) -> dict:
    (code,) = [code for name, code in EXAMPLES if name == title]
    scope: dict = {"__name__": "__docs__"}
    exec(compile(code, f"docs/python-api.md: {title}", "exec"), scope)
    return scope


def test_the_docs_hold_the_four_examples():
    assert [name for name, _ in EXAMPLES] == [
        "A format-plus-peers reward",
        "A dataset from `datasets`, with renamed columns",
        "A callback that logs each member's agreement",
        "A callback that stops the run early",
    ]


def test_the_format_plus_peers_reward(demo_folder):
    scope = _run("A format-plus-peers reward")
    assert scope["summary"]["reward_mode"] == "none"
    assert [f["name"] for f in scope["summary"]["reward_functions"]] == ["closes_its_answer", "agrees_with_peers"]
    rows = metrics(demo_folder / "runs" / "api_rewards")
    assert sorted((r["step"], r["member"]) for r in rows) == [(1, "llama"), (1, "qwen"), (2, "llama"), (2, "qwen")]
    assert all(r["reward_closes_its_answer"] is not None for r in rows)


def test_the_dataset_with_renamed_columns(demo_folder):
    scope = _run("A dataset from `datasets`, with renamed columns")
    assert scope["summary"]["data"]["kept"] == 64
    saved = yaml.safe_load((demo_folder / "runs" / "api_dataset" / "config.yaml").read_text())
    assert saved["data"]["train"]["loader"] == "python"
    assert saved["data"]["train"]["options"]["fields"] == {"question": "query", "answer": "label", "images": "picture"}
    rows = metrics(demo_folder / "runs" / "api_dataset")
    # the renamed answer column reached the diagnostics (answer_acc is measured against it)
    assert len(rows) == 4 and all(r["answer_acc"] is not None for r in rows)


def test_the_callback_that_logs_agreement(demo_folder, capsys):
    scope = _run("A callback that logs each member's agreement")
    assert sorted(scope["log"].rows)[0][:2] == (1, "llama") and len(scope["log"].rows) == 4
    assert scope["summary"]["run_dir"] == "runs/api_example" and "step 2 qwen: agreement" in capsys.readouterr().out


def test_the_callback_that_stops_the_run_early(demo_folder):
    scope = _run("A callback that stops the run early")
    summary = scope["summary"]
    assert summary["steps"] == 1 and summary["stopped_by_callback"] == {
        "callback": "TimeBudget",
        "event": "on_step_end",
        "step": 1,
        "reason": "time budget of 0 s spent",
    }
    assert summary["checkpoint"] == "runs/api_budget/checkpoints/step-1"
    assert sorted(r["step"] for r in metrics(demo_folder / "runs" / "api_budget")) == [1, 1]

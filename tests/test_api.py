"""The Python API (issue 35, first part): `CohortTrainer(config, callbacks=...).train()` is what `corl train`
runs; callbacks see each event on the main process, and one that raises stops the run on every rank, named,
with the last checkpoint intact."""

from __future__ import annotations

import json

import pytest
from cohort_helpers import cohort, metrics, on_ranks

from vlm_corl import CallbackFailed, CohortTrainer
from vlm_corl.config import ConfigError
from vlm_corl.training.callbacks import Callbacks
from vlm_corl.training.checkpoint import load_cohort_state


class Recorder:
    """Every event it is given, in order."""

    def __init__(self):
        self.events = []

    def on_train_begin(self):
        self.events.append(("begin",))

    def on_step_end(self, step, metrics):
        self.events.append(("step", step, sorted(row["member"] for row in metrics)))

    def on_evaluate(self, step, results):
        self.events.append(("evaluate", step, sorted({row["member"] for row in results})))

    def on_save(self, step, path):
        self.events.append(("save", step, path.name, path.is_dir()))

    def on_train_end(self, summary):
        self.events.append(("end", summary["run_dir"]))


def _config(tiny_zoo, tmp_path) -> dict:
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward={"mode": "ring"})
    cfg["train"]["save_every"] = 1
    cfg["eval"] = {"every": 2, "benchmarks": ["easyvqa"], "limit": 3, "max_new_tokens": 4}
    return cfg


def test_a_dict_config_trains_and_the_callbacks_see_every_event_in_order(tiny_zoo, tmp_path):
    recorder = Recorder()
    summary = CohortTrainer(_config(tiny_zoo, tmp_path), callbacks=[recorder]).train()
    run_dir = str(tmp_path / "run")
    assert summary["run_dir"] == run_dir
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["run_dir"] == run_dir
    assert recorder.events == [
        ("begin",),
        ("evaluate", 0, ["l", "q"]),  # the step-0 baseline
        ("save", 1, "step-1", True),
        ("step", 1, ["l", "q"]),
        ("save", 2, "step-2", True),
        ("evaluate", 2, ["l", "q"]),
        ("step", 2, ["l", "q"]),
        ("end", run_dir),
    ]
    assert sorted((r["step"], r["member"]) for r in metrics(tmp_path / "run")) == [
        (1, "l"),
        (1, "q"),
        (2, "l"),
        (2, "q"),
    ]


class FailsAtStep1:
    def on_step_end(self, step, metrics):
        raise ValueError("no such column")


def test_a_callback_that_raises_stops_the_run_named_and_the_checkpoint_stays_intact(tiny_zoo, tmp_path):
    with pytest.raises(CallbackFailed) as err:
        CohortTrainer(_config(tiny_zoo, tmp_path), callbacks=[FailsAtStep1()]).train()
    assert "callback FailsAtStep1.on_step_end raised at step 1: ValueError: no such column" in str(err.value)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-1"
    assert f"the last complete checkpoint, {checkpoint}, is intact" in str(err.value)
    assert load_cohort_state(checkpoint)["step"] == 1
    assert not (tmp_path / "run" / "checkpoints" / "step-2").exists()


def test_config_mistakes_and_callbacks_without_events_are_refused_before_training(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    cfg["rollout"]["n"] = 0
    with pytest.raises(ConfigError, match="rollout.n"):
        CohortTrainer(cfg)
    with pytest.raises(ConfigError, match="rollout.temperature"):
        CohortTrainer(_config(tiny_zoo, tmp_path), overrides=["rollout.temperature=-1"])
    with pytest.raises(TypeError, match="callback object has none of the methods on_train_begin"):
        CohortTrainer(_config(tiny_zoo, tmp_path), callbacks=[object()])


def test_a_failure_on_the_main_rank_stops_every_rank(tmp_path):
    """Callbacks run on rank 0 only; its failure reaches rank 1 at the agreement point, so no rank waits alone."""

    def on_rank(world):
        callbacks = Callbacks([FailsAtStep1()], is_main=world.is_main)
        callbacks.fire("on_step_end", 1, 1, [])
        try:
            callbacks.agree(world, tmp_path, None)
        except CallbackFailed as err:
            return str(err)
        return None

    first, second = on_ranks(2, on_rank)
    assert first == second and "FailsAtStep1.on_step_end raised at step 1" in first
    assert "no checkpoint was written yet" in first


def test_the_docs_example_runs(tiny_zoo, tmp_path, monkeypatch, capsys):
    """docs/python-api.md's example as written, on zoo members in place of the demo's base models."""
    import re

    import yaml
    from cohort_helpers import ROOT

    text = (ROOT / "docs" / "python-api.md").read_text()
    (code,) = re.findall(r"```python\n(from vlm_corl.*?)```", text, re.S)
    cfg = cohort(tmp_path, [("qwen", tiny_zoo["qwen2_vl"]), ("llama", tiny_zoo["mllama"])], reward={"mode": "ring"})
    (tmp_path / "configs" / "cohorts").mkdir(parents=True)
    (tmp_path / "configs" / "cohorts" / "tiny_easyvqa.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/python-api.md", "exec"), scope)
    assert sorted(scope["log"].rows)[0][:2] == (1, "llama") and len(scope["log"].rows) == 4
    assert scope["summary"]["run_dir"] == "runs/api_example" and "step 2 qwen: agreement" in capsys.readouterr().out

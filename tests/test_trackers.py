"""Experiment trackers (logging.report_to) and sampled responses (samples.jsonl), offline: a W&B offline run, an
MLflow file store and trackio's local store hold every logged step of both members' series; TensorBoard the same
tags; samples.jsonl every member's responses, votes, labels (and from which slots), rewards and advantages; the
report renders them with the picture; a missing package is a config error naming the extra; a tracker that fails
to start is a user error, and so is one that does not start within logging.tracker_timeout_s; one that fails later
only stops reporting."""

from __future__ import annotations

import glob
import json
import logging
import sqlite3
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from cohort_helpers import cohort

from vlm_corl.config import config_from_dict
from vlm_corl.config.parse import ConfigError
from vlm_corl.errors import UserError
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.monitor import trackers
from vlm_corl.training.monitor.samples import SampleSettings, label_sources, sample_rows, samples_due
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput


def _run(tmp: Path, base_models: dict, report_to: list[str], **logging_) -> Path:
    cfg = cohort(
        tmp,
        [("q", base_models["qwen2_vl"]), ("m", base_models["mllama"])],
        reward={"mode": "ring"},
        logging={"report_to": report_to, "progress": False, "samples_every": 1, "samples_per_step": 2, **logging_},
    )
    cfg["members"][0]["lora"] = {"r": 4, "alpha": 8.0}  # the acceptance run: one LoRA member, one full
    run_cohort(config_from_dict(cfg))
    return tmp / "run"


def wandb_history(run_dir: Path) -> dict[int, set[str]]:
    """{step: the series logged at it} from a W&B offline run's .wandb file (LevelDB-log framed protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, part, history = Path(path).read_bytes(), 7, 32768, b"", {}
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                keys = {i.key or "/".join(i.nested_key) for i in record.history.item}
                history.setdefault(int(record.history.step.num), set()).update(keys)
    return history


def test_wandb_offline_and_tensorboard_hold_both_members_series_and_samples_are_written(
    base_models, tmp_path, monkeypatch
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = _run(tmp_path, base_models, ["tensorboard", "wandb"])
    history = wandb_history(run)
    assert sorted(history) == [1, 2]
    for step in (1, 2):
        assert {"q/reward_mean", "m/reward_mean", "q/loss", "m/grad_norm"} <= history[step]
    assert "samples/_type" in history[1] and "samples/_type" in history[2]  # the sampled responses: W&B tables
    assert len(glob.glob(str(run / "wandb" / "offline-run-*" / "files" / "media" / "table" / "samples_*.json"))) == 2
    # TensorBoard: one run per member with the same tag names (members overlay); text in the cohort's run
    for member in ("q", "m"):
        events = EventAccumulator(str(run / "tensorboard" / member))
        events.Reload()
        assert {"reward_mean", "loss", "grad_norm"} <= set(events.Tags()["scalars"])
        assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == []
    assert any(t.startswith("samples/") for t in events.Tags()["tensors"])  # text summaries are stored as tensors
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    for row in rows:
        assert set(row["members"]) == {"q", "m"} and row["gold"] and row["image"].endswith(".png")
        for m in row["members"].values():
            assert len(m["responses"]) == len(m["answers"]) == len(m["rewards"]) == len(m["advantages"]) == 4
            assert "vote" in m and "label" in m
    # ring: q's label is m's vote and the other way round, named when there is one
    q = rows[0]["members"]["q"]
    assert q["label_from"] == (["m"] if q["label"] is not None else [])
    from vlm_corl.reporting.markdown import render_report

    render_report(run)
    page = (run / "samples.md").read_text()
    assert rows[-1]["example_id"] in page and "(sample_images/" in page
    assert "samples.md" in (run / "report.md").read_text()


def test_mlflow_and_trackio_hold_the_logged_steps(base_models, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = _run(tmp_path, base_models, ["mlflow", "trackio"], samples_every=0)
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    for series in ("q/reward_mean", "m/reward_mean"):
        assert [m.step for m in client.get_metric_history(found.info.run_id, series)] == [1, 2]
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"config.json", "summary.json"} <= artifacts
    assert not (run / "samples.jsonl").exists()  # samples_every 0
    (db,) = glob.glob(str(tmp_path / "trackio" / "*.db"))
    logged = sqlite3.connect(db).execute("select step, metrics from metrics").fetchall()
    assert sorted(step for step, _ in logged) == [1, 2]
    assert all({"q/reward_mean", "m/reward_mean"} <= set(json.loads(m)) for _, m in logged)


def test_a_missing_tracker_package_is_a_config_error_naming_the_extra(tiny_zoo, tmp_path, monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"})
    cfg["logging"]["report_to"] = ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match=r"logging\.report_to: wandb needs the 'wandb' package.*co-rl\[wandb\]"):
        config_from_dict(cfg)
    cfg["logging"]["report_to"] = ["comet"]
    with pytest.raises(ConfigError, match=r"logging\.report_to\[0\]: 'comet' is not valid"):
        config_from_dict(cfg)


class _Failing(trackers.Tracker):
    def __init__(self, run_dir, config, name, fail_at_start=False, timeout_s=30.0):
        if fail_at_start:
            raise ConnectionError("no network")

    def scalars(self, values, step):
        raise RuntimeError("server went away")


def test_a_tracker_that_cannot_start_is_a_user_error_one_failing_later_only_stops_reporting(tmp_path, caplog):
    trackers.TRACKERS["tensorboard_test"] = lambda *a, **k: _Failing(*a, fail_at_start=True)
    trackers.HINTS["tensorboard_test"] = "check it"
    try:
        with pytest.raises(UserError, match=r"tensorboard_test could not start \(ConnectionError: no network\)"):
            _start_unchecked(["tensorboard_test"], tmp_path)
        trackers.TRACKERS["tensorboard_test"] = _Failing
        (guarded,) = _start_unchecked(["tensorboard_test"], tmp_path)
        with caplog.at_level(logging.WARNING, logger="vlm_corl"):
            guarded.scalars({"a": 1.0}, 1)
            guarded.scalars({"a": 2.0}, 2)  # no second warning, no exception
        assert caplog.text.count("tensorboard_test failed (RuntimeError: server went away)") == 1
    finally:
        trackers.TRACKERS.pop("tensorboard_test")
        trackers.HINTS.pop("tensorboard_test")


def test_a_run_that_raised_ends_its_mlflow_and_wandb_runs_as_failed(tmp_path, monkeypatch):
    """A run that raises finishes its trackers without a summary (vlm_corl.training.run.release): their runs end
    failed, not finished, as a process that died would have left them."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    statuses = []
    for summary in (None, {"steps": 2}):
        tracker = trackers.start_within("mlflow", tmp_path, {}, "x", 30.0)  # as a run starts it: its own thread
        tracker.finish(summary)
        statuses.append(MlflowClient((tmp_path / "mlruns").resolve().as_uri()).get_run(tracker.run_id).info.status)
    assert statuses == ["FAILED", "FINISHED"]

    class WandbRun:
        summary, exit_codes = {}, []

        def finish(self, exit_code=None):
            self.exit_codes.append(exit_code)

    wandb = trackers.WandB.__new__(trackers.WandB)
    wandb.run = WandbRun()
    wandb.finish(None)
    wandb.finish({"steps": 2})
    assert WandbRun.exit_codes == [1, 0]


def _start_unchecked(names, run_dir, **kwargs):
    check = trackers.check_trackers
    trackers.check_trackers = lambda names: None  # the stand-in has no package to find
    try:
        return trackers.start_trackers(names, run_dir, {}, "x", **kwargs)
    finally:
        trackers.check_trackers = check


class _Hanging(trackers.Tracker):
    """A client whose start blocks like a bad W&B key or an unreachable MLflow server (minutes of retries)."""

    began: list[float] = []
    released = threading.Event()
    finished = threading.Event()

    def __init__(self, run_dir, config, name, timeout_s):
        self.began.append(time.monotonic())
        self.released.wait(60)

    def finish(self, summary):
        self.finished.set()


def test_a_tracker_start_that_hangs_stops_the_run_within_tracker_timeout_s(tiny_zoo, tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "wandb", _Hanging)
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"})
    cfg["logging"].update(report_to=["tensorboard", "wandb"], tracker_timeout_s=1.5)
    with pytest.raises(UserError) as err:
        run_cohort(config_from_dict(cfg))
    (began,) = _Hanging.began
    assert time.monotonic() - began < 1.5 + 3  # the bound (and the start of the run's end), not minutes of retries
    message = str(err.value)
    assert message.startswith("logging.report_to: wandb did not start within 1.5 s (logging.tracker_timeout_s)")
    assert "raise logging.tracker_timeout_s, or remove wandb from logging.report_to" in message
    (thread,) = [t for t in threading.enumerate() if t.name == "start-wandb"]
    assert thread.daemon and thread.is_alive()  # still blocked; a daemon does not keep the process alive
    _Hanging.released.set()  # a start that ends after its deadline closes what it opened
    thread.join(10)
    assert _Hanging.finished.is_set()
    # a start within the bound is used as before
    monkeypatch.setitem(trackers.TRACKERS, "wandb", lambda *a, **k: trackers.Tracker())
    assert [t.name for t in _start_unchecked(["wandb"], tmp_path, timeout_s=1.5)] == ["wandb"]


def test_tracker_timeout_s_is_a_logging_field_above_zero(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"})
    assert config_from_dict(cfg).logging.tracker_timeout_s == 30.0
    cfg["logging"]["tracker_timeout_s"] = 0
    with pytest.raises(ConfigError, match=r"logging\.tracker_timeout_s: must be > 0, got 0"):
        config_from_dict(cfg)


def test_label_sources_follow_the_reward_topology():
    assert label_sources("ring", 0, 3) == [2] and label_sources("ring", 2, 3) == [1]
    assert label_sources("peers", 1, 3) == [0, 2] and label_sources("soft", 0, 2) == [1]
    assert label_sources("self_vote", 1, 3) == [1] and label_sources("gt", 0, 2) == "gold"
    assert label_sources("co_rewarding_2", 0, 2) == [1] and label_sources("co_rewarding_2", 3, 4) == [2]
    assert [s for s in range(1, 25) if samples_due(s, 10)] == [1, 10, 20] and not samples_due(1, 0)


def test_sample_rows_name_the_peers_whose_votes_gave_the_label():
    from vlm_corl.data.records import Example

    answers = [[["a", "a", "b", "a"]], [["a", "b", "b", "b"]], [["a", "a", "c", "a"]]]  # votes a, b, a
    batch = CohortBatch(
        ("x", "y", "z"), answers, [[["t"] * 4]] * 3, [[[True] * 4]] * 3, [None], [None]
    )  # fmt: skip
    labels = [["a"], ["a"], ["b"]]  # a stand-in reward output: the labels as given
    scored = RewardOutput(torch.ones(3, 1, 4), {}, labels)
    adv = [torch.zeros(1, 4)] * 3
    settings = SampleSettings("peers", 0.0, 4)
    (row,) = sample_rows(5, [Example(id="e1", question="q?", answer="a")], batch, scored, adv, settings)
    assert row["members"]["x"]["label_from"] == ["z"]  # of x's peers y (b) and z (a), z voted the label a
    assert row["members"]["y"]["label_from"] == ["x", "z"]
    assert row["members"]["z"]["label_from"] == ["y"]
    assert row["members"]["y"]["vote"] == "b" and row["gold"] == "a" and row["step"] == 5

"""The numerical guard (vlm_corl.training.run.numerics, Member.step, vlm_corl.members.finite): a non-finite loss or
gradient skips the member's optimizer step (weights, Adam moments and schedule unchanged), is counted in
metrics.jsonl and logged, and after train.max_nonfinite_steps in a row stops the run with exit 3 naming the
member; the ranks of a member agree (a NaN on one rank skips the step on both); DeepSpeed members likewise;
non-finite weights are refused at load and non-finite logits stop a rollout naming the member; a diverging
run (lr 1e12) stops cleanly with no non-finite checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cohort_helpers import ROOT, cohort, python_m
from safetensors.torch import load_file, save_file

from vlm_corl.config import config_from_dict
from vlm_corl.config.schema import MemberConfig, TrainConfig
from vlm_corl.members.finite import NonFiniteWeights
from vlm_corl.members.member import load_member
from vlm_corl.training.run.numerics import NonFiniteTracker, not_finite

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests"), "FAULT_MEMBER": "a"}


def _snapshot(member):
    return (
        {n: p.detach().clone() for n, p in member.model.named_parameters()},
        {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in member.optimizer.state.items()
        },
        member.scheduler.last_epoch,
    )


def test_a_nonfinite_loss_skips_the_step_and_leaves_weights_moments_and_schedule(tiny_zoo):
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])))
    m.setup_optimizer(TrainConfig(lr=1e-3, warmup_ratio=0.0), 10)
    ids = torch.tensor([[1, 2, 3, 4]])

    def loss_of():
        return m.model(input_ids=ids).logits.float().mean()

    loss = loss_of()
    m.backward(loss)
    assert m.step(1.0, loss=loss.detach())[1]  # a finite step applies
    before = _snapshot(m)
    loss = loss_of() * float("nan")
    m.backward(loss)
    norm, applied = m.step(1.0, loss=loss.detach())
    assert not applied and norm != norm
    after = _snapshot(m)
    assert all(torch.equal(before[0][n], after[0][n]) for n in before[0])  # weights
    assert before[2] == after[2]  # schedule
    for key, state in before[1].items():  # Adam's moments and step count
        assert all(
            torch.equal(v, after[1][key][n]) if torch.is_tensor(v) else v == after[1][key][n] for n, v in state.items()
        )
    assert all(float(p.grad.abs().sum()) == 0 for p in m.model.parameters() if p.grad is not None)  # zeroed
    # a finite loss whose gradient is infinite is skipped too
    loss = loss_of()
    m.backward(loss * 0 + next(m.model.parameters()).sum() * float("inf"))
    assert not m.step(1.0, loss=loss.detach())[1]


def test_the_tracker_stops_after_consecutive_skips_only(caplog):
    from vlm_corl.training.run.numerics import NonFiniteStopped

    tracker = NonFiniteTracker(limit=2)
    skip, ok = {"nonfinite_skipped": 1, "loss": float("nan"), "grad_norm": 3.0}, {"nonfinite_skipped": 0}
    tracker.observe(1, {"a": skip, "b": ok}, None, True)
    tracker.observe(2, {"a": ok, "b": ok}, None, True)  # the streak resets
    tracker.observe(3, {"a": skip, "b": ok}, None, True)
    assert "member a, step 1: loss nan" in caplog.text
    with pytest.raises(NonFiniteStopped, match=r"member 'a' .* 2 consecutive steps \(the last: step 4, loss nan\)"):
        tracker.observe(4, {"a": skip, "b": ok}, Path("run/checkpoints/step-2"), False)
    assert tracker.total == {"a": 3}
    resumed = NonFiniteTracker(limit=2)  # a resumed run starts from its metrics rows: counts and the open streak
    resumed.restore([{"member": "a", "nonfinite_skipped": 1}, {"member": "a", "nonfinite_skipped": 0},
                     {"member": "a", "nonfinite_skipped": 1}, {"member": "b", "nonfinite_skipped": None}])  # fmt: skip
    assert resumed.total == {"a": 2} and resumed.streaks == {"a": 1}
    with pytest.raises(NonFiniteStopped):
        resumed.observe(9, {"a": skip}, None, False)
    assert not_finite({"loss": 1.0, "grad_norm": float("inf")}) == "gradient norm inf"


def _config(tmp_path: Path, tiny_zoo, **train) -> Path:
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])], reward={"mode": "entropy"})
    cfg["train"].update(max_steps=5, save_every=1, **train)
    path = tmp_path / "cohort.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(path: Path, procs: int = 1, **env) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    return subprocess.run(
        [sys.executable, *launch, str(ROOT / "tests" / "nonfinite_worker.py"), "--config", str(path)],
        cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _finite_checkpoints(run: Path) -> bool:
    files = list((run / "checkpoints").rglob("model.safetensors"))
    return bool(files) and all(bool(torch.isfinite(t).all()) for f in files for t in load_file(f).values())


@pytest.mark.parametrize("procs, fault_rank", [(1, None), (2, "1")], ids=["one process", "two processes, rank 1"])
def test_a_member_that_keeps_diverging_stops_the_run_with_exit_3(tiny_zoo, tmp_path, procs, fault_rank):
    path = _config(tmp_path, tiny_zoo)
    if procs == 2:  # both members data-parallel over both ranks; the NaN only on rank 1
        cfg = yaml.safe_load(path.read_text())
        for m in cfg["members"]:
            m["ranks"] = [0, 1]
        path.write_text(yaml.safe_dump(cfg))
    env = {"FAULT_RANK": fault_rank} if fault_rank else {}
    result = _run(path, procs, **env)
    if procs == 1:
        assert result.returncode == 3, result.stderr[-3000:]
    else:  # torchrun exits 1 when a worker fails; every worker stopped with 3 (both agreed, neither hung)
        assert result.returncode == 1 and result.stderr.count("exitcode  : 3") == 2, result.stderr[-3000:]
    assert "numerical guard: member 'a' had a non-finite loss or gradient norm at 3 consecutive steps" in result.stderr
    assert "the last complete checkpoint is" in result.stderr
    assert "vlm_corl/" not in result.stderr  # no traceback through our code (torchrun prints its own)
    rows = _rows(tmp_path / "run")
    assert [(r["step"], r["nonfinite_skipped"]) for r in rows if r["member"] == "a"] == [(1, 1), (2, 1), (3, 1)]
    assert all(r["nonfinite_skipped"] == 0 for r in rows if r["member"] == "b")
    first = load_file(tiny_zoo["qwen2_vl"] / "model.safetensors")
    saved = load_file(tmp_path / "run" / "checkpoints" / "step-3" / "a" / "model.safetensors")
    assert all(torch.equal(first[k], saved[k]) for k in first)  # a's weights were never updated (every rank)
    assert _finite_checkpoints(tmp_path / "run")


def test_deepspeed_members_skip_a_nonfinite_step_alike(tiny_zoo, tmp_path):
    path = _config(
        tmp_path, tiny_zoo, deepspeed=str(ROOT / "configs" / "deepspeed" / "zero2.json"), max_nonfinite_steps=2
    )
    result = _run(path, DS_ACCELERATOR="cpu")
    assert result.returncode == 3, result.stderr[-3000:]
    assert "member 'a' had a non-finite loss or gradient norm at 2 consecutive steps" in result.stderr
    rows = _rows(tmp_path / "run")
    assert [r["nonfinite_skipped"] for r in rows if r["member"] == "a"] == [1, 1]
    assert [r["nonfinite_skipped"] for r in rows if r["member"] == "b"] == [0, 0]
    assert _finite_checkpoints(tmp_path / "run")


def test_a_diverging_learning_rate_stops_cleanly_without_a_nonfinite_checkpoint(tiny_zoo, tmp_path):
    path = _config(tmp_path, tiny_zoo, lr=1e12, warmup_ratio=0.0)
    result = python_m("vlm_corl.train", "--config", path)
    if result.returncode == 3:  # the usual way: the diverged weights overflow in the next forward pass
        assert "numerical guard" in result.stderr and "member '" in result.stderr
    else:  # or every non-finite step is skipped and counted
        assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert _finite_checkpoints(tmp_path / "run")


def test_nonfinite_weights_are_refused_at_load_naming_the_tensor(tiny_zoo, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_zoo["qwen2_vl"], broken)
    weights = load_file(broken / "model.safetensors")
    name = sorted(weights)[3]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    tail = re.escape(name.removeprefix("model."))  # the module's name may nest it (model.language_model....)
    with pytest.raises(NonFiniteWeights, match=f"member 'x' .*weight '[a-z_.]*{tail}' holds 1 non-finite value"):
        load_member(MemberConfig(id="x", model=str(broken)))


def test_nonfinite_logits_stop_a_rollout_naming_the_member(tiny_zoo, tmp_path):
    from vlm_corl.training.loop import run_cohort
    from vlm_corl.training.run.numerics import NonFiniteStopped

    cfg = config_from_dict(cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])]))
    import vlm_corl.members.engines.hf as hf

    original = hf.HFEngine.generate

    def poisoned(self, prompts, params):
        if self.member.id == "b":
            with torch.no_grad():
                next(p for n, p in self.member.model.named_parameters() if "lm_head" in n or "embed" in n).fill_(
                    float("nan")
                )
        return original(self, prompts, params)

    hf.HFEngine.generate = poisoned
    try:
        with pytest.raises(
            NonFiniteStopped, match="step 1 \\(rollout\\): member 'b': its forward pass gave non-finite"
        ):
            run_cohort(cfg)
    finally:
        hf.HFEngine.generate = original


def test_no_checkpoint_is_written_with_nonfinite_weights(tmp_path):
    """The replica checksum pass before every checkpoint refuses weights holding NaN (the guards upstream should
    make this unreachable; this is the last line)."""
    from types import SimpleNamespace

    from vlm_corl.distributed.world import World
    from vlm_corl.training.phases.checkpoint_phase import _check_replicas
    from vlm_corl.training.run.numerics import NonFiniteStopped

    def model(name, value):
        weights = [("w", torch.tensor([1.0, value]))]
        return SimpleNamespace(id=name, full_weights=lambda: iter(weights))

    run = SimpleNamespace(world=World(), run_dir=tmp_path)
    assert set(_check_replicas(run, [model("a", 2.0)])) == {"a"}
    with pytest.raises(NonFiniteStopped, match="the weights of 'b' are not finite; no checkpoint was written"):
        _check_replicas(run, [model("a", 2.0), model("b", float("nan"))])

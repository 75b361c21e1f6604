"""bench/rollout.py (HF engine side) and bench/gpu_check.sh (its CPU fallback) at their smallest sizes, so
neither breaks before a GPU or the vLLM lane runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_rollout_benchmark_hf_side(tiny_zoo):
    proc = subprocess.run(
        [
            sys.executable,
            "bench/rollout.py",
            "--model",
            str(tiny_zoo["qwen3"]),
            "--engines",
            "hf",
            "--prompts",
            "2",
            "--n",
            "2",
            "--max-new-tokens",
            "4",
            "--rounds",
            "1",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["hf"]["tokens"] > 0 and result["hf"]["tokens_per_s"] > 0 and "vllm" not in result


def gpu_check(*args: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """bench/gpu_check.sh with `args`: the finished process and its JSON (stdout holds only the JSON, whatever
    the libraries print)."""
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    return proc, json.loads(proc.stdout)


# bench/gpu_check.sh's checks, in its order: the default suite runs the first group, `make test-scale` (with the
# DeepSpeed members of tests/test_scale_out.py) the members trained by the update's engines (about 2 minutes more)
CHECKS = ["members", "train", "static_autocast", "decode_sync", "preflight", "zero2", "lora", "resume",
          "rollout_precision", "zero3", "zero3_offload", "rope_buffers"]  # fmt: skip
UPDATE_ENGINES = ("zero2", "lora", "resume", "zero3", "zero3_offload")


def _gpu_check_checks(tmp_path, names: list[str], *more: str) -> dict:
    """gpu_check.sh at the tiny size on the CPU with `--only names`: every check ran, in a process each whose
    directory is deleted once read, and the report's common fields; its JSON."""
    proc, result = gpu_check("--size", "tiny", "--steps", "2", "--out", str(tmp_path), "--only", ",".join(names), *more,
                             timeout=600)  # fmt: skip
    assert proc.returncode == 0 and result["ok"], json.dumps(result)[-3000:]
    assert result["mode"] == "cpu fallback" and result["vllm"].startswith("skipped")
    assert result["peft"] and result["transformers"]  # the versions the check ran with
    assert result["ran"] == names and len({result[c]["pid"] for c in names}) == len(names)  # a process each
    for name in names:
        assert result[name]["seconds"] > 0 and "busy_share" in result[name], name
        assert name == "members" or not (tmp_path / name).exists(), f"{name}'s directory was not deleted"
        assert name == "members" or result[name]["disk_gb"] < 0.1  # tiny members; real ones stay under ~15 GB
    assert result["rerun"] is None and {v["library"] for v in result["versions"]} >= {"torch", "vllm"}
    return result


def _trained_fine(result: dict, run: str) -> None:
    """A training check's figures: two steps, speed, a finite loss, the plan, the update's work in fp32."""
    qwen = result[run]["qwen"]
    assert result[run]["steps"] == 2 and qwen["time_step"] > 0 and qwen["tokens_per_s"] > 0 and qwen["loss_finite"]
    assert qwen["prompt_cache_mb"] > 0 and result[run]["plan"]["fits"] and result[run]["plan"]["peak_gb"] > 0
    assert qwen["update_tokens"] > 0 and qwen["compute_dtype"] == "float32"  # the CPU computes in fp32
    assert 0 < result[run]["update_mfu"] and result[run]["update_tflops"] > 0


def test_gpu_check_runs_in_its_cpu_fallback_mode(tmp_path):
    """bench/gpu_check.sh at the tiny size on the CPU: the checks it runs on a lent GPU (real-size members, training
    with its memory plan (profiled), the static KV cache of a trainable member against the eager loop, the decode
    loop's schedules teacher-forced (the static KV cache's among them), the users' preflight, rollout precision,
    the ZeRO-3 copy's fp32 RoPE buffers) run here too and report their JSON; then `--only` reruns one over the
    members already built. The update engines' checks: test_gpu_checks_of_the_update_engines (make test-scale)."""
    names = [c for c in CHECKS if c not in UPDATE_ENGINES]
    result = _gpu_check_checks(tmp_path, names, "--profile")
    assert result["members"]["parameters"]["qwen"] > 0 and result["members"]["peak_tflops"] > 0
    preflight = result["preflight"]  # the users' preflight over the check's members (tests/test_preflight.py)
    assert preflight["ok"] and preflight["verdict"] == "ready" and set(preflight["members"]) == {"qwen", "intern"}
    assert all(m["push_gap_nats"] < 1e-3 and m["update"]["trained_seqs"] > 0 for m in preflight["members"].values())
    assert 0 < preflight["checkpoint"]["bytes"] < 2**20 * 5  # a LoRA adapter: no full checkpoint on a small disk
    cached = result["rollout_precision"]["autocast_cached"]["weight_casts_per_call"]
    assert 0 < cached < result["rollout_precision"]["autocast_inference_mode"]["weight_casts_per_call"]
    sync = result["decode_sync"]
    assert sync["sync_every"] == 1 and sync["ready_decode_mask"] and sync["tokens"] > 0  # CPU: a read every token
    assert 0 < sync["rows_ended_early"] < sync["rows"]  # rows leave the batch mid-way, at staggered steps
    assert set(sync["logprob_gap"]) == {"chosen", "ready", "reserved", "static"}
    assert sync["differ_beyond_numerics"] == []
    assert sync["static_fallbacks"] == [] and sync["static_first_call_seconds"] > 0  # the static cache decoded
    assert set(sync["tokens_per_s"]) == set(sync["schedule_seconds"]) and all(sync["tokens_per_s"].values())
    assert all(gap["max_abs"] <= 1e-5 for gap in sync["logprob_gap"].values())  # fp32 on the CPU: bit-equal
    static = result["static_autocast"]  # the static path with a trainable member (fp32 masters), against eager
    assert static["ok"] and static["static_fallbacks"] == [] and static["rows"] == 4 and static["prompt_tokens"] > 64
    assert static["eager"]["tokens_per_s"] > 0 and static["static"]["tokens_per_s"] > 0
    assert static["plan_rollout_gb"]["static"] > 0 and static["buckets_after_sleep_mb"] >= 0
    profile = result["train"]["profile"]  # --profile: the last step's ten costliest operators per phase
    assert set(profile) == {"rollout", "update"} and all(len(ops) == 10 for ops in profile.values())
    assert result["expected_seconds"]["train"] > 0
    assert result["sleep_wake"]["skipped"] and result["rope_buffers"]["inv_freq_dtypes"] == ["torch.float32"]
    errors = result["rope_buffers"]["mean_abs_logit_error"]
    assert result["rope_buffers"]["ok"] and errors["fp32_buffers"] <= errors["bf16_buffers"]
    _trained_fine(result, "train")
    assert result["train"]["intern"]["update_tokens"] > 0

    rerun, again = gpu_check("--size", "tiny", "--only", "rope_buffers", "--out", str(tmp_path), timeout=300)
    assert rerun.returncode == 0 and again["ran"] == ["rope_buffers"] and again["rope_buffers"]["ok"]


@pytest.mark.slow
def test_gpu_checks_of_the_update_engines(tmp_path):
    """The rest of bench/gpu_check.sh on the CPU: ZeRO-2, ZeRO-3 and ZeRO-3 offload members, a LoRA member, a kill
    and resume (the members built first, as a rerun with --only does when they are not there)."""
    result = _gpu_check_checks(tmp_path, ["members", *UPDATE_ENGINES])
    assert result["zero2"]["update_plan_gb"] > 0  # the measured peak beside it needs CUDA
    for run in ("zero2", "zero3", "lora", "zero3_offload"):
        _trained_fine(result, run)
    assert result["resume"]["ok"] and result["resume"]["steps_logged"] == [1, 2, 3, 4, 5, 6]
    assert 0 < result["lora"]["adapter_mb"] < result["lora"]["model_mb"]


def test_gpu_check_kills_a_check_past_its_own_limit(tmp_path):
    """A check that outlives its limit is killed with its whole process group and reported, and the next runs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    args = SimpleNamespace(size="tiny", steps=2)
    (tmp_path / "members").mkdir()
    report = gpu_check.run_in_process("members", args, tmp_path, limit=0.5)
    assert report["error"].startswith("the check's process ended without a report: timed out after")
    assert not gpu_check.check_ok(report) and report["seconds"] < 30


def test_a_check_the_budget_left_cannot_cover_is_skipped_and_the_result_stays_ok(tmp_path, monkeypatch, capfd):
    """The scheduler of `main` at the real size with stand-in checks (a stand-in for each check's process: it
    takes TAKES[name] seconds of a fake clock, or is killed at the limit it was given, as the real one reports).
    members (31.6 s expected, H200-measured) and train (88.6 s) fit the 150 s budget; zero2 (49.3 s expected)
    then has 40 s left: it must be skipped, not started and killed as a failure, and rope_buffers (18.3 s) still
    runs after it. Overall ok, exit 0, and the rerun names zero2."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    takes = {"members": 30.0, "train": 80.0, "zero2": 49.0, "rope_buffers": 15.0}
    clock = SimpleNamespace(now=0.0)
    started = []

    def check_process(name, args, work, limit, whose="its own"):
        started.append(name)
        clock.now += min(takes[name], limit)
        if takes[name] > limit:
            error = f"the check's process ended without a report: timed out after {limit:.0f} s ({whose} limit)"
            return {"error": error, "timed_out": whose, "log_tail": "", "seconds": limit, "busy_share": None}
        return {"seconds": takes[name], "busy_share": None}

    monkeypatch.setattr(gpu_check, "run_in_process", check_process)
    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    models = tmp_path / "models"
    models.mkdir()
    (models / "members.json").write_text(json.dumps({"size": "real"}))  # built by an earlier call
    argv = ["--size", "real", "--budget", "150", "--out", str(tmp_path), "--only", "members,train,zero2,rope_buffers"]
    code = gpu_check.main(argv)
    result = json.loads(capfd.readouterr().out)
    assert started == ["members", "train", "rope_buffers"]
    assert "expected to take 49.3 s" in result["zero2"]["skipped"] and "--only zero2" in result["zero2"]["skipped"]
    assert result["ran"] == ["members", "train", "rope_buffers"] and result["ok"] and code == 0
    assert result["rerun"].startswith("--only zero2 ")
    assert json.loads((tmp_path / "seconds.json").read_text()) == {k: takes[k] for k in started}  # kept for next


def test_gpu_check_help_lists_every_check():
    """`bench/gpu_check.py --help` runs (argparse only: no check starts) and names every check `--only` takes."""
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("members", "train", "static_autocast", "decode_sync", "preflight", "zero3", "zero3_offload",
                 "rollout_precision", "rope_buffers"):  # fmt: skip
        assert name in proc.stdout.replace("\n", "").replace(" ", ""), name


def test_soak_bench_at_its_smallest_size_does_not_grow():
    """bench/soak.py: a tiny cohort's resident set, open files and threads stay flat over a short run (the
    prompt cache fills within its 64 MB budget; checkpoints are written and pruned on the way)."""
    proc = subprocess.run(
        [sys.executable, "bench/soak.py", "--steps", "160", "--window", "40", "--save-every", "50"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], json.dumps(report)[-2000:]
    assert report["steps"] == 160 and len(report["windows"]) == 4
    assert report["rss_growth"] <= 0.10 and report["open_files_growth"] <= 2 and report["threads_growth"] <= 0
    assert 0 < report["windows"][-1]["prompt_cache_mb"] <= 64

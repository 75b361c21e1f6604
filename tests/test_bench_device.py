"""bench/rollout.py (HF engine side) and bench/gpu_check.sh (its CPU fallback) at their smallest sizes, so
neither breaks before a GPU or the vLLM lane runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


def test_gpu_check_runs_in_its_cpu_fallback_mode(tmp_path):
    """bench/gpu_check.sh at the tiny size on the CPU: every check it runs on a lent GPU (real-size members,
    training with its memory plan, ZeRO-2, ZeRO-3 and ZeRO-3 offload, a LoRA member, a kill and resume, the
    decode loop's schedules teacher-forced (the static KV cache's among them), rollout precision, the ZeRO-3
    copy's fp32 RoPE buffers) runs here too, each in a process of its own whose directory is deleted once read,
    and reports its JSON; then `--only` reruns one over the members already built."""
    proc, result = gpu_check("--size", "tiny", "--steps", "2", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0 and result["ok"], json.dumps(result)[-3000:]
    assert result["mode"] == "cpu fallback" and result["vllm"].startswith("skipped")
    assert result["peft"] and result["transformers"]  # the versions the check ran with
    checks = ["members", "preflight", "train", "zero2", "lora", "resume", "decode_sync", "rope_buffers",
              "rollout_precision", "zero3", "zero3_offload"]  # fmt: skip
    assert result["ran"] == checks and len({result[c]["pid"] for c in checks}) == len(checks)  # a process each
    for name in checks:
        assert result[name]["seconds"] > 0 and "busy_share" in result[name], name
        assert name == "members" or not (tmp_path / name).exists(), f"{name}'s directory was not deleted"
    assert result["members"]["parameters"]["qwen"] > 0 and result["members"]["peak_tflops"] > 0
    preflight = result["preflight"]  # the users' preflight over the check's members (tests/test_preflight.py)
    assert preflight["ok"] and preflight["verdict"] == "ready" and set(preflight["members"]) == {"qwen", "intern"}
    assert all(m["push_gap_nats"] < 1e-3 and m["update"]["trained_seqs"] > 0 for m in preflight["members"].values())
    assert preflight["checkpoint"]["bytes"] > 0 and {v["library"] for v in result["versions"]} >= {"torch", "vllm"}
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
    assert result["sleep_wake"]["skipped"] and result["rope_buffers"]["inv_freq_dtypes"] == ["torch.float32"]
    errors = result["rope_buffers"]["mean_abs_logit_error"]
    assert result["rope_buffers"]["ok"] and errors["fp32_buffers"] <= errors["bf16_buffers"]
    assert result["zero2"]["update_plan_gb"] > 0  # the measured peak beside it needs CUDA
    for run in ("train", "zero2", "zero3", "lora", "zero3_offload"):
        qwen = result[run]["qwen"]
        assert result[run]["steps"] == 2 and qwen["time_step"] > 0 and qwen["tokens_per_s"] > 0 and qwen["loss_finite"]
        assert qwen["prompt_cache_mb"] > 0 and result[run]["plan"]["fits"] and result[run]["plan"]["peak_gb"] > 0
        assert qwen["update_tokens"] > 0 and qwen["compute_dtype"] == "float32"  # the CPU computes in fp32
        assert 0 < result[run]["update_mfu"] and result[run]["update_tflops"] > 0
    assert result["train"]["intern"]["update_tokens"] > 0
    assert result["resume"]["ok"] and result["resume"]["steps_logged"] == [1, 2, 3, 4, 5, 6]
    assert 0 < result["lora"]["adapter_mb"] < result["lora"]["model_mb"]
    assert all(result[c]["disk_gb"] < 0.1 for c in checks[1:])  # tiny members; real ones stay under ~15 GB

    rerun, again = gpu_check("--size", "tiny", "--only", "rope_buffers", "--out", str(tmp_path), timeout=300)
    assert rerun.returncode == 0 and again["ran"] == ["rope_buffers"] and again["rope_buffers"]["ok"]


def test_gpu_check_kills_a_check_past_its_own_limit(tmp_path):
    """A check that outlives its limit is killed with its whole process group and reported, and the next runs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    args = SimpleNamespace(size="tiny", steps=2)
    (tmp_path / "members").mkdir()
    report = gpu_check.run_in_process("members", args, tmp_path, limit=0.5)
    assert report["error"].startswith("the check's process ended without a report: timed out after")
    assert not gpu_check.check_ok(report) and report["seconds"] < 30


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

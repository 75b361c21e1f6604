"""bench/rollout.py (HF engine side) and bench/gpu_check.sh (its CPU fallback) at their smallest sizes, so
neither breaks before a GPU or the vLLM lane runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_gpu_check_runs_in_its_cpu_fallback_mode(tmp_path):
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--size", "tiny", "--steps", "2", "--out", str(tmp_path)],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=480,
    )
    result = json.loads(proc.stdout)  # stdout holds only the JSON, whatever the libraries print
    assert proc.returncode == 0 and result["ok"], json.dumps(result)[-3000:]
    assert result["mode"] == "cpu fallback" and result["vllm"].startswith("skipped")
    assert result["hf_engine"]["tokens_per_s"] > 0
    for run in ("train_bf16", "train_zero2"):
        assert result[run]["steps"] == 2 and result[run]["median_step_s"] > 0 and result[run]["peak_memory_gb"] > 0

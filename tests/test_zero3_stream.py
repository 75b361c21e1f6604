"""ZeRO-3 without a full copy of the weights (`rollout.engine: vllm`): the weights stream a bucket at a time
(`Member.full_weights`) into checkpoints, checksums, EMA teachers and the vLLM sync, and scoring passes run
through the engine in lockstep. Both members are partitioned before DeepSpeed sees them (no rank ever holds the
whole model plus gradients: the start-up peak that would OOM an 11B member on an 80 GB card, whose size only a
GPU shows), and the HF engine's copy is refreshed a bucket at a time. tests/zero3_stream_worker.py checks each
against a twin member that keeps the copy, over 2 gloo processes; in the vLLM lane the synced engine must also
decode what the saved weights decode."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
CHECKS = (
    "initial_equal",
    "partitioned_before_initialize",
    "adam_state_at_build",
    "refresh_in_buckets",
    "updated",
    "stream_equals_copy",
    "stream_names",
    "checksum_equal",
    "ema_equal",
    "scoring_close",
    "saved_equal",
)


def _run_worker(model: Path, out: Path, *flags: str) -> list[dict]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(ROOT / "tests" / "zero3_stream_worker.py"),
            str(model),
            str(out),
            *flags,
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_a_partitioned_member_streams_what_a_full_copy_holds(tiny_zoo, tmp_path):
    for rank, result in enumerate(_run_worker(tiny_zoo["qwen2_vl"], tmp_path)):
        assert {k: result[k] for k in CHECKS} == dict.fromkeys(CHECKS, True), f"rank {rank}: {result}"


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("deepspeed") is None,
    reason="needs vllm and deepspeed: the vLLM lane (`make test-vllm`)",
)
def test_the_vllm_engine_of_a_partitioned_member_decodes_its_saved_weights(tmp_path):
    from vlm_corl.models.zoo import build_zoo

    model = build_zoo(tmp_path / "zoo", families=["qwen2"], size="small")["qwen2"]
    for rank, result in enumerate(_run_worker(model, tmp_path / "out", "--vllm")):
        assert {k: result[k] for k in (*CHECKS, "vllm_equals_hf")} == dict.fromkeys(
            (*CHECKS, "vllm_equals_hf"), True
        ), f"rank {rank}: {result}"

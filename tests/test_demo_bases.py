"""The shipped demo base models are what the demo's recipe builds (issue 37): rebuilt with the demo's pinned
kernels (one thread, AVX2 kernels), a base model's weights are, bit for bit, the ones recorded for the CPU model
(tests/fixtures/demo_base_rebuilds.json; on the AMD EPYC the shipped ones; the Intel Xeon computes others, issue
46). Slow (a 1000-step warm start, ~2 minutes): run by `make test-e2e`, with the demo's `--rebuild-base` path at
toy size."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cohort_helpers import ROOT, python_m
from safetensors.torch import load_file

from vlm_corl.commands.demo import PINNED_KERNELS, SHIPPED_BASES, machine

BUILD = """
import sys
from pathlib import Path
from vlm_corl.models.base_models import build_base
from vlm_corl.commands.demo import base_recipes
mid = sys.argv[1]
build_base(mid, base_recipes({mid: ""}, None)[mid], Path(sys.argv[2]), 0)
"""


REBUILDS_FILE = Path(__file__).parent / "fixtures" / "demo_base_rebuilds.json"
REBUILDS = json.loads(REBUILDS_FILE.read_text())["qwen2_vl_b"]


def weights_digest(tensors: dict) -> str:
    """sha256 of a model's tensors by name (name, dtype, raw bytes): equal digests, equal weights bit for bit."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode() + str(t.dtype).encode() + t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_the_shipped_base_is_the_one_recorded_for_the_cpu_it_was_built_on():
    shipped = load_file(SHIPPED_BASES / "qwen2_vl_b" / "model.safetensors")
    assert weights_digest(shipped) == REBUILDS["AMD EPYC"]


@pytest.mark.slow
def test_a_rebuilt_base_model_is_the_one_recorded_for_this_cpu_model_bit_for_bit(tmp_path):
    """The same CPU model rebuilds the same weights (on the AMD EPYC: the shipped ones). Another CPU model may
    compute others from the same recipe (the Intel Xeon does: docs/demo.md), so a CPU model without a record is
    skipped, naming it and how to add one."""
    cpu = machine()["cpu"]
    if cpu not in REBUILDS:
        pytest.skip(f"no rebuild of qwen2_vl_b recorded for CPU {cpu!r}: add its digest to {REBUILDS_FILE}")
    env = {**os.environ, **PINNED_KERNELS}
    subprocess.run([sys.executable, "-c", BUILD, "qwen2_vl_b", tmp_path / "base"], check=True, env=env)
    rebuilt = load_file(Path(tmp_path / "base" / "model.safetensors"))
    assert weights_digest(rebuilt) == REBUILDS[cpu], cpu


@pytest.mark.slow
def test_the_demo_rebuilds_its_base_models_when_asked(tmp_path):
    """`--rebuild-base` at toy size: the zoo members warm-started (2 steps) by the demo's worker processes, then
    scored and trained as usual; demo.json records each build."""
    args = ["--config", ROOT / "configs" / "cohorts" / "tiny_easyvqa.yaml", "--rebuild-base", "--warm-steps", "2"]
    args += ["--eval-limit", "3", "train.max_steps=1", "data.batch_size=2", "rollout.n=2", "logging.report_to=[]"]
    demo = python_m("vlm_corl.demo", *args, cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "demo" / "demo.json").read_text())
    assert sorted(result["base_models"]) == ["qwen2_vl", "qwen2_vl_b", "qwen2_vl_c", "qwen2_vl_d"]
    assert all(b["steps"] == 2 for b in result["base_models"].values())

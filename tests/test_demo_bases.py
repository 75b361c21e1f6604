"""The shipped demo base models are what the demo's recipe builds (issue 37): rebuilt with the demo's pinned
kernels (one thread, AVX2 kernels), a base model's weights equal the shipped ones bit for bit. Slow (a 1000-step
warm start, ~2 minutes): run by `make test-e2e`, with the demo's `--rebuild-base` path at toy size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cohort_helpers import ROOT, python_m
from safetensors.torch import load_file

from vlm_corl.demo import PINNED_KERNELS, SHIPPED_BASES

BUILD = """
import sys
from pathlib import Path
from vlm_corl.base_models import build_base
from vlm_corl.demo import base_recipes
mid = sys.argv[1]
build_base(mid, base_recipes({mid: ""}, None)[mid], Path(sys.argv[2]), 0)
"""


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="2026-12-04: on a fresh install the rebuild differs from the shipped base, at landed main 1fa5bc3 too "
    "(and make demo prints +1.54, not the published +1.42): an unpinned dependency drifted; not accelerate 1.16 "
    "nor pillow 12.3 (both tried). Find and pin it, then make this strict again",
)
def test_a_rebuilt_base_model_equals_the_shipped_one_bit_for_bit(tmp_path):
    env = {**os.environ, **PINNED_KERNELS}
    subprocess.run([sys.executable, "-c", BUILD, "qwen2_vl_b", tmp_path / "base"], check=True, env=env)
    rebuilt = load_file(Path(tmp_path / "base" / "model.safetensors"))
    shipped = load_file(SHIPPED_BASES / "qwen2_vl_b" / "model.safetensors")
    assert rebuilt.keys() == shipped.keys()
    different = [k for k in shipped if not (rebuilt[k] == shipped[k]).all()]
    assert different == []


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

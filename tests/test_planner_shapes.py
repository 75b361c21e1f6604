"""Issue 50: a plan reads each member's model once. `planning.shapes.cohort_shapes` is built at the plan's start
and passed down (layout, engines, host, disk, and the plans `micro_batch_for`, `fixes` and `suggest` make of the
same members); no part of the planner calls `model_shape` again. Counted with a stand-in that wraps
`model_shape` wherever a module holds it, so a module that imported it and reads a model on its own is counted."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from cohort_helpers import ROOT

from vlm_corl.config import config_from_dict
from vlm_corl.members.memory import GB
from vlm_corl.planning import shapes
from vlm_corl.planning.cohort import Hardware, plan_cohort
from vlm_corl.planning.disk import checkpoint_disk
from vlm_corl.planning.fixes import fixes
from vlm_corl.planning.suggest import suggest

MODELS = ROOT / "configs" / "models"
QWEN3B, INTERN = (str(MODELS / n) for n in ("qwen2.5-vl-3b-instruct", "internvl3-2b-hf"))
ZERO3_OFFLOAD = str(ROOT / "configs" / "deepspeed" / "zero3_offload.json")


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """{model directory: model_shape calls}, over every module that holds `model_shape`."""
    counted: Counter = Counter()
    real = shapes.model_shape

    def model_shape(model_dir: str):
        counted[model_dir] += 1
        return real(model_dir)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("vlm_corl") and getattr(module, "model_shape", None) is real:
            monkeypatch.setattr(module, "model_shape", model_shape)
    return counted


def three_members(engine: str = "vllm", **train):
    """Three members of two models (two share Qwen2.5-VL-3B), EMA teachers, vLLM with sleep mode: every
    sub-planner that needs a shape (engines, host backups and offload, disk's teachers) has one to ask for."""
    return config_from_dict(
        {
            "members": [
                {"id": "qwen", "model": QWEN3B},
                {"id": "qwen_lora", "model": QWEN3B, "lora": {"r": 8}},
                {"id": "intern", "model": INTERN, "trainable": False},
            ],
            "reward": {"mode": "peers_ema"},
            "rollout": {"engine": engine, "vllm": {"gpu_memory_utilization": 0.2, "enable_sleep_mode": True}},
            "train": {"micro_batch_size": "auto", "gradient_checkpointing": False, **train},
            "data": {"batch_size": 8},
        }
    )


def test_a_plan_reads_each_distinct_model_once(reads):
    # micro_batch_size auto on CUDA: the plan tries several sizes, each a whole plan of the same members
    plan = plan_cohort(three_members(deepspeed=ZERO3_OFFLOAD), Hardware(3, 80 * GB, ranks_per_node=2))
    assert dict(reads) == {QWEN3B: 1, INTERN: 1}
    assert plan.shapes["qwen"] is plan.shapes["qwen_lora"] and set(plan.shapes) == {"qwen", "qwen_lora", "intern"}
    assert plan.host.ranks and plan.disk.members["qwen.teacher"]  # host and disk were planned from those shapes


def test_fixes_and_suggest_plan_with_the_shapes_read_once(reads):
    cfg = three_members("hf", micro_batch_size=8)
    plan = plan_cohort(cfg, Hardware(3, 40 * GB))
    reads.clear()
    assert len(fixes(cfg, plan)) > 1  # several changes, each planned
    assert not reads  # with plan.shapes
    suggest(cfg, Hardware(3, 40 * GB))
    assert dict(reads) == {QWEN3B: 1, INTERN: 1}  # one read for the whole search


def test_the_disk_check_without_a_plan_reads_each_model_once(reads):
    cfg = three_members()
    assert checkpoint_disk(cfg).members == plan_cohort(cfg, Hardware(3, 80 * GB)).disk.members
    assert dict(reads) == {QWEN3B: 2, INTERN: 2}  # once by the disk check alone, once by the plan

"""The memory arithmetic of a member's states (vlm_corl.members.memory): bytes per rank by part, worked by hand;
the real-size architectures under configs/models/ (parameter counts on the meta device within 1% of the
published ones). The README's table comes from the planner (tests/test_planner.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlm_corl.members.memory import Layout, member_bytes
from vlm_corl.planning.shapes import parameter_count

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
PUBLISHED = json.loads((MODELS / "models.json").read_text())


def test_bytes_per_rank_by_layout_worked_by_hand():
    p = 1_000_000_000
    assert sum(member_bytes(p, Layout()).values()) == 16e9  # fp32 weights, gradients, two moments
    zero2 = member_bytes(p, Layout(zero=2, ranks=4))
    assert zero2["weights"] == 4e9 and zero2["gradients"] == 1e9 and zero2["optimizer"] == 3e9  # 4 + 16/4
    zero3 = member_bytes(p, Layout(zero=3, ranks=8, engine="vllm"))
    assert zero3 == {"weights": 0.5e9, "gradients": 0.5e9, "optimizer": 1.5e9, "full_copy": 0.0, "engine_weights": 2e9}
    assert member_bytes(p, Layout(zero=3, ranks=8))["full_copy"] == 2e9  # the HF engine's bf16 copy
    offload = member_bytes(p, Layout(zero=3, ranks=8, offload_optimizer=True, offload_params=True))
    assert sum(offload.values()) == 2e9
    assert sum(member_bytes(p, Layout(trainable=False, engine="vllm")).values()) == 4e9  # bf16 peer + its engine
    extras = member_bytes(p, Layout(kl_reference=True, ema_teacher=True))
    assert extras["kl_reference"] == 2e9 and extras["ema_teacher"] == 4e9 + 2e9  # fp32, and a bf16 copy to sample
    frozen_fp32 = Layout(trainable=False, frozen_bytes=4)  # cast once to the bf16 rollout dtype at load
    assert member_bytes(p, frozen_fp32)["weights"] == 2e9
    assert member_bytes(p, Layout(ema_teacher=True, rollout_bytes=4))["ema_teacher"] == 4e9  # fp32 rollouts: no copy


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_architectures_have_their_published_parameter_counts(name):
    """No download: the config.json alone, instantiated on the meta device."""
    count = parameter_count(MODELS / name)
    assert abs(count / PUBLISHED[name]["published_parameters"] - 1) < 0.01, count

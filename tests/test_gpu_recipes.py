"""The real-model GPU recipes under configs/cohorts/ validate (placement and vLLM engine layout included) with
the released architectures of configs/models/ in place of the downloaded checkpoints, and their states fit the
cards they name by the memory arithmetic (vlm_corl.members.memory), beside the vLLM share they give."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlm_corl.config import load_config, read_raw_config
from vlm_corl.distributed.world import place_members
from vlm_corl.members.memory import GB, layout_of, member_bytes, parameter_count

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"gpu_1node_3vlm.yaml": (8, 80), "gpu_1gpu_2vlm.yaml": (1, 80)}  # processes, GB per card


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_gpu_recipe_validates_and_fits_its_cards(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = ROOT / "configs" / "cohorts" / recipe
    processes, card_gb = RECIPES[recipe]
    members = read_raw_config(path)["members"]  # the downloaded checkpoints' paths: the released architectures
    overrides = [f"members.{i}.model=configs/models/{Path(m['model']).name}" for i, m in enumerate(members)]
    cfg = load_config(path, overrides, processes=processes)
    placement = place_members(cfg.members, processes)
    per_rank: dict[int, float] = {}
    for m in cfg.members:
        layout = layout_of(cfg, m, len(placement[m.id]))
        parts = member_bytes(parameter_count(m.model), layout)
        states = sum(v for k, v in parts.items() if k != "engine_weights")  # engine weights: in vLLM's share
        for r in placement[m.id]:
            per_rank[r] = per_rank.get(r, 0.0) + states / GB
    share = cfg.rollout.vllm.gpu_memory_utilization * card_gb
    assert cfg.train.gradient_checkpointing and cfg.rollout.dtype == "auto" and cfg.train.mixed_precision == "auto"
    worst = max(per_rank.values())
    assert worst + share <= 0.85 * card_gb, f"rank states {per_rank} GB + vLLM share {share} GB"

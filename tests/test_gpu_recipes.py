"""The real-model GPU recipes under configs/cohorts/ validate (placement and vLLM engine layout included) with
the released architectures of configs/models/ in place of the downloaded checkpoints, and the memory planner
(vlm_corl.planning) finds that every rank fits the cards they name, with room to spare."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlm_corl.config import load_config, read_raw_config
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import Hardware, plan_cohort

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
    plan = plan_cohort(cfg, Hardware(processes, card_gb * GB))
    assert cfg.train.gradient_checkpointing and cfg.rollout.dtype == "auto" and cfg.train.mixed_precision == "auto"
    assert plan.fits, [r.to_dict() for r in plan.ranks if not r.fits]
    assert plan.worst.peak <= 0.85 * card_gb * GB, plan.worst.to_dict()  # room for what the plan cannot see

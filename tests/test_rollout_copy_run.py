"""Issue 55 through the real loop on a CPU: a trained member on the HF engine with rollouts in bf16 (what
rollout.dtype auto decides on CUDA) samples from its bf16 rollout copy, which holds its fp32 masters as they are
at every rollout: the initial ones, the updated ones after the sync, and the restored ones after a resume."""

from __future__ import annotations

import torch
from cohort_helpers import cohort

from vlm_corl.config import config_from_dict
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.rewards.reward_funcs import RewardFunction


def alternate(*, completions, **_):
    """Rewards that vary within every group: every update moves the weights."""
    return [float(i % 2) for i in range(len(completions))]


REWARDS = [RewardFunction(alternate, "alternate")]


def _record(monkeypatch) -> list[tuple[dict, dict, bool]]:
    """(the member's fp32 masters, the weights its rollout samples from, whether that is its copy), per rollout."""
    seen = []
    real = HFEngine.generate

    def recording(self, prompts, params):
        member = self.member
        masters = {n: p.detach().clone() for n, p in member.model.named_parameters()}
        served = {n: p.detach().clone() for n, p in member.generation_module.named_parameters()}
        seen.append((masters, served, member.generation_module is member.rollout_copy))
        return real(self, prompts, params)

    monkeypatch.setattr(HFEngine, "generate", recording)
    return seen


def _is_cast(served: dict, masters: dict) -> bool:
    return all(served[n].dtype == torch.bfloat16 and served[n].equal(masters[n].to(torch.bfloat16)) for n in masters)


def test_a_trained_members_rollouts_sample_its_masters_through_the_bf16_copy_also_after_a_resume(
    tiny_zoo, tmp_path, monkeypatch
):
    seen = _record(monkeypatch)
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"},
                 train={"max_steps": 2, "lr": 1e-3, "save_every": 1, "warmup_ratio": 0.0})  # fmt: skip
    cfg["rollout"]["dtype"] = "bfloat16"
    run_cohort(config_from_dict(cfg), reward_funcs=REWARDS)
    assert len(seen) == 2 and all(copy for _, _, copy in seen)
    (start, first, _), (moved, second, _) = seen
    assert not all(moved[n].equal(start[n]) for n in start)  # update 1 moved the masters
    assert _is_cast(first, start) and _is_cast(second, moved)  # the copy followed them at the sync
    # resumed from step 1's checkpoint: the copy is built from the restored masters (exactly the fp32 ones: the
    # zoo saves fp32 and the masters go to the trainer state otherwise)
    cfg["train"]["max_steps"], cfg["train"]["resume"] = 3, True
    run_cohort(config_from_dict(cfg), reward_funcs=REWARDS)
    restored, served, copy = seen[2]
    assert len(seen) == 3 and copy and _is_cast(served, restored)

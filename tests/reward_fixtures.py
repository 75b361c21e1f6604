"""Custom cohort rewards used by the tests (named in configs as "reward_fixtures:<function>")."""

import torch

from vlm_corl.training.rewards import RewardOutput


def shorter_is_better(batch, cfg) -> RewardOutput:
    """-len(text)/100 per response: always varies within a group, so even a random model gets a gradient."""
    lengths = torch.tensor([[[len(t) for t in g] for g in m] for m in batch.texts], dtype=torch.float32)
    n, b, _ = lengths.shape
    return RewardOutput(-lengths / 100, {"length": lengths}, [[None] * b for _ in range(n)])


def constant(batch, cfg) -> RewardOutput:
    """The same reward for every response: every group has zero variance (nothing to learn)."""
    n, b, k = batch.shape
    ones = torch.ones(n, b, k)
    return RewardOutput(ones, {"constant": ones}, [[None] * b for _ in range(n)])

"""Where rewards and advantages come from, pure and hand-tested: the reward modes (`modes`: Co-RL's ring, peers,
soft, peers_ema and the baselines), the users' reward functions (`reward_funcs`), GRPO's advantages, objectives and
corrections (`grpo`), DAPO's dynamic sampling (`dynamic_sampling`) and the probe's label headroom (`headroom`).
Imports no other training room.

`vlm_corl.training.rewards` was the reward modes' module: its names still resolve here (users' scripts import
them), on first use."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    """`vlm_corl.training.rewards.X` for a name of `modes` (the module's old path), imported when first asked."""
    modes = importlib.import_module("vlm_corl.training.rewards.modes")
    try:
        return getattr(modes, name)
    except AttributeError:
        raise AttributeError(f"module 'vlm_corl.training.rewards' has no attribute {name!r}") from None

"""Reward functions used by the tests (named in configs as "reward_fixtures:<function>"; the contract of
vlm_corl.training.reward_funcs)."""


def shorter_is_better(*, completions, **_) -> list[float]:
    """-len(text)/100 per response: always varies within a group, so even a random model gets a gradient."""
    return [-len(t) / 100 for t in completions]


def constant(*, completions, **_) -> list[float]:
    """The same reward for every response: every group has zero variance (nothing to learn)."""
    return [1.0] * len(completions)

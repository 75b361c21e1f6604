"""Reward functions used by the tests (named in configs as "reward_fixtures:<function>"; the contract of
vlm_corl.training.rewards.reward_funcs)."""


def shorter_is_better(*, completions, **_) -> list[float]:
    """-len(text)/100 per response: always varies within a group, so even a random model gets a gradient."""
    return [-len(t) / 100 for t in completions]


def constant(*, completions, **_) -> list[float]:
    """The same reward for every response: every group has zero variance (nothing to learn)."""
    return [1.0] * len(completions)


def zero_variance_on_yes_no(*, completions, question_type, **_) -> list[float]:
    """1.0 for every response to a yes/no question (zero variance: nothing to learn), the completion's index
    elsewhere (every group varies, whatever the texts): dynamic sampling's questions are known from the data."""
    return [1.0 if kind == "yes/no" else float(i) for i, kind in enumerate(question_type)]

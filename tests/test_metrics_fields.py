"""The numbers a GRPO researcher reads first (issue 56 item 2, docs/metrics.md), checked by hand: the clip
fractions of ratios set here (`grpo.clip_counts`, and through `update.policy_update` against ratios recomputed
from the weights), the KL to the reference and the policy's token entropy of one update against an independent
computation, the importance ratio's extremes over a member's ranks, and the per-slot batch figures (response
lengths, equal-reward groups). The runs that log them all are in tests/test_objectives_train.py."""

from __future__ import annotations

import pytest
import torch

# setup: that module's fixture (a tiny member and two real rollouts), taken as the tests' argument
from test_policy_update import noisy_reference, policy_logprobs, setup, tokens, update  # noqa: F401

from vlm_corl.config import AlgoConfig
from vlm_corl.members.update import response_token_stats
from vlm_corl.training.monitor.metrics import zero_variance_frac
from vlm_corl.training.phases.step_metrics import member_stats
from vlm_corl.training.rewards.grpo import (
    cispo_loss,
    clip_counts,
    clipped_surrogate,
    gspo_surrogate,
    kl_penalty,
    rollout_is_weights,
    sapo_loss,
)

# Two sequences of 3 tokens (the second's last is padding, its ratio would clip), ratios pi / pi_old set per token.
RATIOS = torch.tensor([[1.5, 0.7, 1.3], [0.5, 1.3, 0.2]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.zeros(2, 3) - 1.0
LOGP = OLD + RATIOS.log()


@pytest.mark.parametrize(
    "adv, low, high",
    [
        ((1.0, -1.0), 1, 2),  # sequence 0 (A > 0): 1.5 and 1.3 over 1.2; sequence 1 (A < 0): 0.5 under 0.9
        ((-1.0, 1.0), 1, 1),  # sequence 0 (A < 0): 0.7 under 0.9; sequence 1 (A > 0): 1.3 over 1.2
        ((0.0, 0.0), 0, 0),  # no advantage: the min keeps the unclipped term, nothing clips
    ],
)
def test_grpo_counts_tokens_clipped_below_with_negative_and_above_with_positive_advantages(adv, low, high):
    """clip_low 0.1, clip_high 0.2: the ratio leaves [0.9, 1.2]. A token counts low when A < 0 and its ratio is
    under 0.9, high when A > 0 and its ratio is over 1.2 (TRL's clip_ratio/low_mean, high_mean); padding never."""
    advantages = torch.tensor(adv)
    _, clipped = clipped_surrogate(LOGP, OLD, advantages, 0.1, 0.2)
    a = advantages[:, None]
    want_low = int(((RATIOS < 0.9) & (a < 0) & MASK.bool()).sum())
    want_high = int(((RATIOS > 1.2) & (a > 0) & MASK.bool()).sum())
    assert (want_low, want_high) == (low, high)
    assert tuple(map(int, clip_counts(clipped, advantages, MASK, "grpo"))) == (low, high)


def test_gspo_counts_sequences_and_cispo_counts_capped_weights_all_high_and_sapo_nothing():
    """gspo's one ratio per sequence: exp(mean log ratio) = (1.5 x 0.7 x 1.3)^(1/3) = 1.11 for sequence 0 (A +1:
    over 1 + 4e-4, high) and (0.5 x 1.3)^(1/2) = 0.81 for sequence 1 (A -1: under 1 - 3e-4, low): one each,
    sequences, not their 3 + 2 tokens. cispo caps the weight at 1.4: the 1.5 token only, whatever its sign
    (high; no lower bound). sapo gates, never clips."""
    adv = torch.tensor([1.0, -1.0])
    _, clipped = gspo_surrogate(LOGP, OLD, adv, MASK, 3e-4, 4e-4)
    assert tuple(map(int, clip_counts(clipped, adv, MASK, "gspo"))) == (1, 1)
    _, capped = cispo_loss(LOGP, OLD, -adv, 1.4)
    assert tuple(map(int, clip_counts(capped, -adv, MASK, "cispo"))) == (0, 1)
    _, gated = sapo_loss(LOGP, OLD, adv, 1.0, 1.05)
    assert tuple(map(int, clip_counts(gated, adv, MASK, "sapo"))) == (0, 0)


def test_the_updates_clip_fractions_are_the_second_passs_ratios_set_by_its_first_step(setup):  # noqa: F811
    """updates_per_batch=2, clip 0.01 each side, lr 3e-2: the second pass's ratios (recomputed here from the
    weights the first step left, against pi_old = the initial weights) leave [0.99, 1.01]. clip_frac_low counts the
    tokens with A < 0 under 0.99, clip_frac_high those with A > 0 over 1.01, over 2 passes x all trained tokens;
    clip_frac is their sum. The entropy is the initial policy's (pi_old's pass), over all trained tokens."""
    member, initial, slots = setup
    seqs = slots[0].sequences()
    two = update(setup, seqs, AlgoConfig(updates_per_batch=2, clip_low=0.01, clip_high=0.01), lr=3e-2)
    member.model.load_state_dict(initial)
    with torch.no_grad():
        old, mask = policy_logprobs(member, seqs)
        member.model.load_state_dict(two.weights[0])
        new, _ = policy_logprobs(member, seqs)
    ratio, real = torch.exp(new - old), mask.bool()
    adv = torch.tensor([s.advantage for s in seqs])[:, None]
    low, high = int(((adv < 0) & (ratio < 0.99) & real).sum()), int(((adv > 0) & (ratio > 1.01) & real).sum())
    assert low > 0 and high > 0  # both sides bind: a swap of the two would show
    n = 2 * tokens(seqs)
    stats = two.stats
    assert (stats["clip_frac_low"], stats["clip_frac_high"]) == (pytest.approx(low / n), pytest.approx(high / n))
    assert stats["clip_frac"] == pytest.approx((low + high) / n)
    assert stats["kl"] is None  # no reference without algo.kl_beta
    member.model.load_state_dict(initial)
    assert stats["entropy"] == pytest.approx(_token_mean_entropy(member, seqs), rel=1e-5)


def test_kl_and_entropy_of_one_update_equal_an_independent_computation(setup, tiny_zoo):  # noqa: F811
    """kl_beta 0.5, k3, a reference model (the initial weights plus seeded noise): `kl` is the mean over the 9
    trained sequences' tokens of exp(ref - logp) - (ref - logp) - 1 at the initial weights (one pass: the
    update's own forward); `entropy` the token-weighted mean of `response_token_stats`' per-response entropies.
    Neither is 0, and the clip fractions of an on-policy pass are."""
    member, initial, slots = setup
    seqs = slots[0].sequences()
    reference = noisy_reference(tiny_zoo)
    stats = update(setup, seqs, AlgoConfig(kl_beta=0.5), reference=reference).stats
    member.model.load_state_dict(initial)
    with torch.no_grad():
        ref, _ = policy_logprobs(member, seqs, model=reference)
        logp, mask = policy_logprobs(member, seqs)
    want = float((kl_penalty(logp, ref, "k3") * mask).sum()) / tokens(seqs)
    assert want > 1e-3 and stats["kl"] == pytest.approx(want, rel=1e-5)
    assert stats["entropy"] == pytest.approx(_token_mean_entropy(member, seqs), rel=1e-5)
    assert (stats["clip_frac"], stats["clip_frac_low"], stats["clip_frac_high"]) == (0.0, 0.0, 0.0)


def _token_mean_entropy(member, seqs) -> float:
    """The policy's mean token entropy over `seqs`' response tokens, from per-response means (another pass)."""
    means = response_token_stats(
        member.model, [s.prompt_inputs for s in seqs], [s.token_ids for s in seqs], member.policy()
    )["entropy"]
    lengths = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.float64)
    value = float((means.double() * lengths).sum() / lengths.sum())
    assert value > 0.1  # a tiny random model: far from a sure next token
    return value


def test_the_importance_ratio_before_the_cap_and_its_extremes_over_the_ranks():
    """Token ratios 4, 0.5 (a NaN engine log-prob excluded, padding too), cap 2: the ratio before the cap has
    mean 2.25, min 0.5, max 4 (the weights are capped at 2). Sequence mode: R = 4 x 0.5 = 2 on both tokens. Over two
    ranks of a member, the log phase's `member_stats` keeps the first rank's sums and takes the extremes' min and
    max (a rank without a finite token reports none)."""
    train = torch.log(torch.tensor([[0.8, 0.2, 0.9, 0.5]]))
    rollout = torch.log(torch.tensor([[0.2, 0.4, float("nan"), 0.5]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, sums = rollout_is_weights(train, rollout, mask, cap=2.0)
    assert float(weights.max()) == pytest.approx(2.0)
    assert float(sums["ratio"]) / float(sums["tokens"]) == pytest.approx(2.25)
    assert (float(sums["ratio_min"]), float(sums["ratio_max"])) == (pytest.approx(0.5), pytest.approx(4.0))
    _, seq = rollout_is_weights(train[:, :2], rollout[:, :2], mask[:, :2], cap=3.0, mode="sequence_truncated")
    assert float(seq["ratio"]) == pytest.approx(4.0) and float(seq["ratio_max"]) == pytest.approx(2.0)
    ranks = [
        {"loss": 1.0, "is_ratio_mean": 1.1, "is_ratio_min": 0.9, "is_ratio_max": 1.2},
        {"loss": 1.0, "is_ratio_mean": 1.1, "is_ratio_min": 0.7, "is_ratio_max": 1.1},
        {"loss": 1.0, "is_ratio_mean": 1.1, "is_ratio_min": float("inf"), "is_ratio_max": float("-inf")},
    ]
    assert member_stats(ranks) == {"loss": 1.0, "is_ratio_mean": 1.1, "is_ratio_min": 0.7, "is_ratio_max": 1.2}
    assert member_stats([{"loss": 2.0}]) == {"loss": 2.0}


def test_the_share_of_groups_with_equal_rewards():
    """Three groups of 3: (1, 1, 1) and (0, 0, 0) are flat, (1, 0, 0) varies: 2 / 3."""
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert zero_variance_frac(rewards) == pytest.approx(2 / 3)
    assert zero_variance_frac(rewards[1:2]) == 0.0

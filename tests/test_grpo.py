"""GRPO maths against numbers worked by hand."""

import math

import pytest
import torch

from vlm_corl.training.rewards.grpo import (
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    kl_penalty,
    nonzero_variance_groups,
    token_entropy,
    token_self_certainty,
)


def test_group_advantages_group_scale():
    # mean 0.5, centred ±0.5, unbiased std sqrt(1/3) -> ±0.5 / 0.57735 = ±0.8660
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), "group", eps=0.0)
    assert torch.allclose(adv[0], torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254]))
    assert torch.isnan(adv[1]).all()  # eps=0 on a constant group divides 0 by 0; the default eps avoids it
    assert torch.equal(group_advantages(torch.ones(1, 4))[0], torch.zeros(4))


def test_group_advantages_batch_and_none_scale():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # batch std of [1, 0, 1, 1]: mean 0.75, sum of squares 0.75, /3 -> 0.25, std 0.5
    assert torch.allclose(group_advantages(rewards, "batch", eps=0.0), torch.tensor([[1.0, -1.0], [0.0, 0.0]]))
    assert torch.allclose(group_advantages(rewards, "none"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    with pytest.raises(ValueError):
        group_advantages(rewards, "bogus")


def test_nonzero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    assert nonzero_variance_groups(rewards).tolist() == [False, True, False]


@pytest.mark.parametrize(
    "ratio, adv, clip_low, clip_high, loss, was_clipped",
    [
        (1.5, 1.0, 0.2, 0.2, -1.2, True),  # gain capped at 1 + 0.2
        (1.5, -1.0, 0.2, 0.2, 1.5, False),  # a harmful step is never clipped away
        (0.5, 1.0, 0.2, 0.2, -0.5, False),
        (0.5, -1.0, 0.2, 0.2, 0.8, True),  # floor at 1 - 0.2
        (1.5, 1.0, 0.2, 0.28, -1.28, True),  # clip-higher
        (1.0, 2.0, 0.2, 0.2, -2.0, False),
        # Unequal bounds: the floor comes from clip_low and the cap from clip_high, never the other way round.
        (0.5, -1.0, 0.3, 0.1, 0.7, True),  # floor at 1 - 0.3 (clip_high's 0.9 would give 0.9)
        (0.5, -1.0, 0.1, 0.4, 0.9, True),  # floor at 1 - 0.1 (clip_high's 0.6 would give 0.6)
        (1.5, 1.0, 0.4, 0.1, -1.1, True),  # cap at 1 + 0.1 (clip_low's 1.4 would give -1.4)
        (0.75, -1.0, 0.3, 0.1, 0.75, False),  # inside [0.7, 1.1]: unclipped (a floor from clip_high would clip)
    ],
)
def test_clipped_surrogate(ratio, adv, clip_low, clip_high, loss, was_clipped):
    logp = torch.tensor([[math.log(ratio)]])
    out, clipped = clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([adv]), clip_low, clip_high)
    assert out.item() == pytest.approx(loss, abs=1e-6)
    assert clipped.item() is was_clipped


def test_kl_estimators():
    logp, ref = torch.tensor([[0.0]]), torch.tensor([[math.log(0.5)]])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + 0.693147 - 1.0, abs=1e-6)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


def test_aggregations_and_micro_batch_exactness():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(2.5)  # 10 / 4 tokens
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)  # (2 + 4) / 2
    assert aggregate_loss(loss, mask, "drgrpo", const_norm=4).item() == pytest.approx(1.25)  # 10 / (2*4)
    for mode in ("token_mean", "seq_mean_token_mean", "drgrpo"):
        full = aggregate_loss(loss, mask, mode, const_norm=4)
        parts = sum(
            aggregate_loss(loss[i : i + 1], mask[i : i + 1], mode, total_tokens=4, total_seqs=2, const_norm=4)
            for i in range(2)
        )
        assert parts.item() == pytest.approx(full.item())


def test_entropy_and_self_certainty():
    logits = torch.log(torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    # H(.75,.25) = .75 ln(4/3) + .25 ln 4 = 0.562335; H(uniform 2) = ln 2
    assert torch.allclose(token_entropy(logits), torch.tensor([0.562335, 0.693147]), atol=1e-6)
    # KL(U || (.75,.25)) = .5 ln(.5/.75) + .5 ln(.5/.25) = 0.143841; zero for uniform
    assert torch.allclose(token_self_certainty(logits), torch.tensor([0.143841, 0.0]), atol=1e-6)


def test_intrinsic_stats_ignore_suppressed_tokens():
    logits = torch.log(torch.tensor([[0.75, 0.25]]))
    with_suppressed = torch.cat([logits, torch.full((1, 3), float("-inf"))], dim=-1)
    assert torch.allclose(token_entropy(with_suppressed), token_entropy(logits))
    assert torch.allclose(token_self_certainty(with_suppressed), token_self_certainty(logits))


def test_advantage_epsilon_is_the_configured_one():
    """algo.adv_eps away from its default 1e-6: rewards (0, 1) have unbiased std 0.7071, so eps 0.5 gives
    advantages -0.5 / 1.2071 and +0.5 / 1.2071; the batch scale divides by the batch's std + eps."""
    rewards = torch.tensor([[0.0, 1.0]])
    std = math.sqrt(0.5)
    assert group_advantages(rewards, "group", 0.5).tolist()[0] == pytest.approx([-0.5 / (std + 0.5), 0.5 / (std + 0.5)])
    assert group_advantages(rewards, "batch", 2.0).tolist()[0] == pytest.approx([-0.5 / (std + 2.0), 0.5 / (std + 2.0)])

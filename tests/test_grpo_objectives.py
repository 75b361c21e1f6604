"""The policy objectives (algo.policy_loss) and the rollout importance corrections (algo.rollout_is) against numbers
worked by hand: values and gradients on one 2-sequence example, padding included.

The example: sequence A has two tokens with log-ratios log pi_theta - log pi_old = [0.3, -0.1] and advantage +1;
sequence B has one token with log-ratio -0.3 and advantage -1, then a padding position holding a junk log-prob
(5.0) that must reach neither a ratio nor a gradient. Token ratios: e^0.3 = 1.349859, e^-0.1 = 0.904837,
e^-0.3 = 0.740818.
"""

import math

import pytest
import torch

from vlm_corl.config import AlgoConfig
from vlm_corl.members.update import policy_token_loss
from vlm_corl.training.rewards.grpo import (
    aggregate_loss,
    cispo_loss,
    clipped_surrogate,
    gspo_surrogate,
    rollout_is_weights,
    sapo_loss,
)

OLD = torch.tensor([[-1.3, -1.9], [-0.2, 0.0]])
MASK = torch.tensor([[1, 1], [1, 0]])
ADV = torch.tensor([1.0, -1.0])


def _logp() -> torch.Tensor:
    return torch.tensor([[-1.0, -2.0], [-0.5, 5.0]], requires_grad=True)  # 5.0: junk on the padding position


def _close(t: torch.Tensor, expected: list) -> bool:
    return torch.allclose(t, torch.tensor(expected), atol=1e-6, rtol=0)


def _grad(loss: torch.Tensor, logp: torch.Tensor, agg: str) -> torch.Tensor:
    aggregate_loss(loss, MASK, agg).backward()
    return logp.grad


def test_grpo_clips_tokens_on_the_example():
    """Clip 0.2: A's first token (1.3499 > 1.2, A > 0) is clipped (-1.2, no gradient), its second is not
    (-0.904837); B's token (0.7408 < 0.8, A < 0) is clipped up to 0.8. The token mean over 3 tokens gives the
    one unclipped token the gradient -0.904837 / 3."""
    logp = _logp()
    loss, clipped = clipped_surrogate(logp, OLD, ADV, 0.2, 0.2)
    assert loss[MASK.bool()].tolist() == pytest.approx([-1.2, -0.904837, 0.8], abs=1e-6)
    assert clipped[MASK.bool()].tolist() == [True, False, True]
    grad = _grad(loss, logp, "token_mean")
    assert _close(grad, [[0.0, -0.904837 / 3], [0.0, 0.0]])


def test_gspo_clips_whole_sequences_by_the_geometric_mean_ratio():
    """s_A = exp((0.3 - 0.1) / 2) = e^0.1 = 1.105171 (inside [0.8, 1.2]: loss -1.105171 on both tokens, neither
    dropped, unlike GRPO's first token); s_B = e^-0.3 = 0.740818 over its one real token (the junk padding would
    give exp((-0.3 + 5.2) / 2)), below 0.8 with A < 0: clipped, loss 0.8, no gradient.
    seq_mean_token_mean = (-1.105171 + 0.8) / 2 = -0.152585 (the paper's 1/G sum_i); each of A's tokens gets
    d/dlogp (1/2)(-s_A) = -s_A / |y_A| / 2 = -0.276293. token_mean: (2 (-1.105171) + 0.8) / 3 = -0.470114, each
    A token -2 s_A / 2 / 3 = -0.368390. The product ratio instead of the geometric mean (e^0.2 = 1.2214) would
    clip A."""
    logp = _logp()
    loss, clipped = gspo_surrogate(logp, OLD, ADV, MASK, 0.2, 0.2)
    assert loss[MASK.bool()].tolist() == pytest.approx([-1.105171, -1.105171, 0.8], abs=1e-6)
    assert clipped[MASK.bool()].tolist() == [False, False, True]
    assert aggregate_loss(loss, MASK, "seq_mean_token_mean").item() == pytest.approx(-0.152585, abs=1e-6)
    assert aggregate_loss(loss, MASK, "token_mean").item() == pytest.approx(-0.470114, abs=1e-6)
    grad = _grad(loss, logp, "seq_mean_token_mean")
    assert _close(grad, [[-0.276293, -0.276293], [0.0, 0.0]])
    logp = _logp()
    grad = _grad(gspo_surrogate(logp, OLD, ADV, MASK, 0.2, 0.2)[0], logp, "token_mean")
    assert _close(grad, [[-0.368390, -0.368390], [0.0, 0.0]])


def test_gspo_clip_bounds_are_each_their_own():
    """Bounds 0.01 below, 0.2 above: s_A = 1.105 stays inside (1.2), s_B = 0.7408 with A < 0 is floored at 0.99
    (loss 0.99); swapped, s_A would be capped at 1.01 (loss -1.01)."""
    loss, clipped = gspo_surrogate(_logp(), OLD, ADV, MASK, 0.01, 0.2)
    assert loss[:, 0].tolist() == pytest.approx([-1.105171, 0.99], abs=1e-6)
    assert clipped[:, 0].tolist() == [False, True]


def test_cispo_weighs_every_token_and_drops_none():
    """Cap 1.2, no lower bound: weights sg(min(r, 1.2)) = [1.2, 0.904837], [0.740818]; loss -w A log pi:
    -1.2 (-1) = 1.2, -0.904837 (-2) = 1.809675, -0.740818 (-1)(-0.5) = -0.370409. Gradient -w A per token, all
    three (GRPO gives A's first and B's token none): / 3 under the token mean: -0.4, -0.301612, +0.246939. The
    weight is a constant: were it differentiated, A's second token would get -(r log pi + r) = +0.904837."""
    logp = _logp()
    loss, clipped = cispo_loss(logp, OLD, ADV, max_weight=1.2)
    assert loss[MASK.bool()].tolist() == pytest.approx([1.2, 1.809675, -0.370409], abs=1e-6)
    assert clipped[MASK.bool()].tolist() == [True, False, False]
    grad = _grad(loss, logp, "token_mean")
    assert _close(grad, [[-0.4, -0.301612], [0.246939, 0.0]])


def test_cispo_lower_bound_when_given():
    """MiniMax-M1's general form clip(r, 1 - eps_low, 1 + eps_high): a floor of 0.8 raises B's weight 0.7408 to
    0.8 (loss -0.8 (-1)(-0.5) = -0.4, flagged)."""
    loss, clipped = cispo_loss(_logp(), OLD, ADV, max_weight=1.2, min_weight=0.8)
    assert loss[1, 0].item() == pytest.approx(-0.4, abs=1e-6) and clipped[1, 0].item()


def test_sapo_gates_smoothly_with_the_temperature_of_the_advantages_sign():
    """f(r) = (4 / tau) sigmoid(tau (r - 1)), tau 1 for A > 0 and 2 for A < 0 (here, to tell them apart):
    A1: sigmoid(0.349859) = 0.586582, loss -4 x 0.586582 = -2.346333; A2: sigmoid(-0.095163) = 0.476228,
    -1.904909; B: sigmoid(2 (-0.259182)) = 0.373235, loss -(4 / 2)(0.373235)(-1) = 0.746470. Gradient
    -A 4 s (1 - s) r: -4 (0.586582)(0.413418)(1.349859) = -1.309381, -0.902792, and for B
    +4 (0.373235)(0.626765)(0.740818) = 0.693200; nothing is clipped. With tau swapped B's value would be
    4 sigmoid(-0.259182) = 1.742..."""
    logp = _logp()
    loss, clipped = sapo_loss(logp, OLD, ADV, tau_pos=1.0, tau_neg=2.0)
    assert loss[MASK.bool()].tolist() == pytest.approx([-2.346333, -1.904909, 0.746470], abs=1e-6)
    assert not clipped.any()
    loss.masked_fill(~MASK.bool(), 0.0).sum().backward()
    assert _close(logp.grad, [[-1.309381, -0.902792], [0.693200, 0.0]])


def test_on_policy_every_objective_gives_the_plain_policy_gradient():
    """At r = 1 (one pass over fresh rollouts) GRPO, GSPO, CISPO and SAPO all give -A d log pi per token (GSPO's
    -A s / |y| summed over |y| tokens under the sequence mean): they differ only off-policy."""
    grads = []
    for fn in (
        lambda lp: clipped_surrogate(lp, lp.detach(), ADV, 0.2, 0.2),
        lambda lp: gspo_surrogate(lp, lp.detach(), ADV, MASK, 3e-4, 4e-4),
        lambda lp: cispo_loss(lp, lp.detach(), ADV, 5.0),
        lambda lp: sapo_loss(lp, lp.detach(), ADV, 1.0, 1.05),
    ):
        logp = _logp()
        grads.append(_grad(fn(logp)[0], logp, "token_mean"))
    for g in grads:
        assert _close(g, [[-1 / 3, -1 / 3], [1 / 3, 0.0]])


def test_each_objective_reads_its_own_fields():
    """`update.policy_token_loss` hands each objective its own settings, with every objective's fields set at once
    to values that tell them apart (a loss reading another objective's field, or a default, gives another number):
    one-token sequences at ratios 1.5 (A +1) and 0.5 (A -1). grpo clip 0.1 / 0.3: [0.9, 1.3] -> losses -1.3
    (capped) and 0.9 (floored); gspo 0.2 / 0.4 (one token: s = r): -1.4 and 0.8; cispo cap 1.25 (not 1 +
    clip_high, no lower bound): weights 1.25 and 0.5, loss -w A log pi with log pi = log 1.5, log 0.5; sapo tau
    1.5 / 2: -(4 / 1.5) sigmoid(0.75) and +2 sigmoid(-1)."""
    logp = torch.log(torch.tensor([[1.5], [0.5]]))
    old, adv, mask = torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    fields = dict(clip_low=0.1, clip_high=0.3, gspo_clip_low=0.2, gspo_clip_high=0.4, cispo_max_weight=1.25)
    fields.update(sapo_tau_pos=1.5, sapo_tau_neg=2.0)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = {
        "grpo": [-1.3, 0.9],
        "gspo": [-1.4, 0.8],
        "cispo": [-1.25 * math.log(1.5), 0.5 * math.log(0.5)],
        "sapo": [-(4 / 1.5) * sigmoid(0.75), 2 * sigmoid(-1.0)],
    }
    for name, values in expected.items():
        loss = policy_token_loss(logp, old, adv, mask, AlgoConfig(policy_loss=name, **fields))[0]
        assert loss.view(-1).tolist() == pytest.approx(values, abs=1e-6), name


# ---- the rollout corrections -------------------------------------------------------------------------------------
# Trainer and engine probabilities of two sequences (3 and 2 tokens, then padding whose junk ratio 9 must not
# count): token ratios [4, 0.5, 1] and [2, 1.2]; sequence ratios (products) R = 2 and 2.4; cap 2.2.
TRAIN = torch.log(torch.tensor([[0.8, 0.2, 0.9], [0.5, 0.6, 0.9]]))
ROLLOUT = torch.log(torch.tensor([[0.2, 0.4, 0.9], [0.25, 0.5, 0.1]]))
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode, weights, capped_tokens, capped_seqs",
    [
        # token 4 > 2.2: truncated to 2.2, or masked to 0; sequence 0 is the one with a capped token
        ("token_truncated", [[2.2, 0.5, 1.0], [2.0, 1.2, 0.0]], 1, 1),
        ("token_mask", [[0.0, 0.5, 1.0], [2.0, 1.2, 0.0]], 1, 1),
        # R_0 = 4 x 0.5 x 1 = 2 (kept, on each of its tokens), R_1 = 2 x 1.2 = 2.4 > 2.2: truncated or dropped;
        # the geometric means (1.26, 1.55) would cap neither
        ("sequence_truncated", [[2.0, 2.0, 2.0], [2.2, 2.2, 0.0]], 2, 1),
        ("sequence_mask", [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]], 2, 1),
    ],
)
def test_rollout_correction_weights_by_hand(mode, weights, capped_tokens, capped_seqs):
    got, sums = rollout_is_weights(TRAIN, ROLLOUT, IS_MASK, cap=2.2, mode=mode)
    assert _close(got, weights)
    assert sums["capped"] == capped_tokens and sums["capped_seqs"] == capped_seqs
    assert sums["tokens"] == 5 and sums["seqs"] == 2 and sums["nonfinite"] == 0
    assert sums["abs_dlogp"] == pytest.approx(math.log(4) + math.log(2) + math.log(2) + math.log(1.2), rel=1e-5)


@pytest.mark.parametrize(
    "mode, weights",
    [
        ("token_truncated", [[2.2, 0.5, 1.0], [2.0, 0.0, 0.0]]),  # only the token without a log-prob leaves
        ("token_mask", [[0.0, 0.5, 1.0], [2.0, 0.0, 0.0]]),
        ("sequence_truncated", [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]),  # R_1 unknown: its whole sequence leaves
        ("sequence_mask", [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]),
    ],
)
def test_a_token_without_an_engine_log_prob(mode, weights):
    rollout = ROLLOUT.clone()
    rollout[1, 1] = float("nan")
    got, sums = rollout_is_weights(TRAIN, rollout, IS_MASK, cap=2.2, mode=mode)
    assert _close(got, weights)
    assert sums["nonfinite"] == 1 and sums["tokens"] == 4 and sums["seqs"] == 2
    assert sums["capped_seqs"] == (1 if mode.startswith("token") else 0)


def test_a_long_sequences_ratio_overflowing_is_capped_not_nan():
    """A 200-token sequence at ratio e per token: R = e^200 overflows fp32 to inf; truncated it is the cap,
    masked 0, never NaN."""
    train, rollout, mask = torch.ones(1, 200), torch.zeros(1, 200), torch.ones(1, 200)
    truncated, _ = rollout_is_weights(train, rollout, mask, 3.0, "sequence_truncated")
    masked, sums = rollout_is_weights(train, rollout, mask, 3.0, "sequence_mask")
    assert torch.equal(truncated, torch.full((1, 200), 3.0)) and torch.equal(masked, torch.zeros(1, 200))
    assert sums["capped_seqs"] == 1 and sums["capped"] == 200

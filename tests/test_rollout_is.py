"""Off-policy correction (algo.rollout_is): the truncated importance weights and mismatch figures by hand, and
their effect on a real update: equal engine and trainer log-probs change nothing, a gap beyond the cap doubles the
policy gradient (cap 2), non-finite engine log-probs are excluded and counted; the masked and sequence-level
modes weigh each sequence as a plain update with its advantage times the weight would (tests/test_grpo_objectives.py
works their weights by hand)."""

import math

import pytest
import torch

from vlm_corl.config import AlgoConfig, MemberConfig, TrainConfig
from vlm_corl.config.schema import RolloutConfig
from vlm_corl.members.member import load_member
from vlm_corl.members.update import Sequence, policy_update, response_logprobs, rollout_mismatch
from vlm_corl.training.rewards.grpo import rollout_is_weights


def test_truncated_weights_and_mismatch_by_hand():
    train = torch.log(torch.tensor([[0.8, 0.2, 0.9, 0.5]]))
    rollout = torch.log(torch.tensor([[0.2, 0.4, 0.9, 0.5]]))
    rollout[0, 2] = float("nan")  # the engine gave no log-prob for this token
    mask = torch.tensor([[1, 1, 1, 0]])  # the last position is padding
    weights, sums = rollout_is_weights(train, rollout, mask, cap=2.0)
    # ratios: 0.8/0.2 = 4 -> capped at 2; 0.2/0.4 = 0.5; NaN -> excluded; padding -> 0
    assert torch.allclose(weights, torch.tensor([[2.0, 0.5, 0.0, 0.0]]))
    assert sums["tokens"] == 2 and sums["capped"] == 1 and sums["nonfinite"] == 1
    assert sums["abs_dlogp"] == pytest.approx(math.log(4) + math.log(2), rel=1e-5)
    k3 = (4 - 1 - math.log(4)) + (0.5 - 1 - math.log(0.5))  # r - 1 - log r per token
    assert sums["kl"] == pytest.approx(k3, rel=1e-5)
    means = rollout_mismatch(sums)
    assert means == pytest.approx(
        {
            "is_abs_dlogp": (math.log(4) + math.log(2)) / 2,
            "is_kl": k3 / 2,
            "is_capped_frac": 0.5,
            "is_capped_seq_frac": 1.0,  # the one sequence has a capped token
            "is_nonfinite_tokens": 1,
        },
        rel=1e-5,
    )


def _update(
    tiny_zoo,
    shift: float | list[float] | None,
    nan_first: bool = False,
    mode: str = "token_truncated",
    passes: int = 1,
    cap: float = 2.0,
    advantages: tuple[float, ...] = (1.0, -1.0, 0.5),
) -> dict:
    """One update of a fresh tiny member on fixed sequences (4, 2 and 3 tokens) whose engine log-probs are the
    trainer's + shift (one for all, or one per sequence)."""
    torch.manual_seed(0)
    member = load_member(MemberConfig(id="t", model=str(tiny_zoo["qwen3"])))
    train = TrainConfig(max_steps=1, lr=1e-3, grad_clip=0.0, micro_batch_size=3, warmup_ratio=0.0)
    member.setup_optimizer(train, 1)
    prompt = member.process(member.apply_chat_template("What is 1 + 1?", 0, None), [])
    responses = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    with torch.no_grad():
        logp, mask = response_logprobs(member.model, [prompt] * 3, responses, member.policy())
    engine = [logp[i, : len(r)].tolist() for i, r in enumerate(responses)]
    if shift is not None:
        shifts = shift if isinstance(shift, list) else [shift] * len(engine)
        engine = [[v + d for v in row] for row, d in zip(engine, shifts)]
    if nan_first:
        engine[0][0] = float("nan")
    seqs = [Sequence(prompt, r, adv, rollout_logprobs=lp) for r, adv, lp in zip(responses, advantages, engine)]
    algo = AlgoConfig(rollout_is=mode, rollout_is_cap=cap, updates_per_batch=passes)
    return policy_update(member, seqs, algo, train, RolloutConfig(max_new_tokens=1))


def test_the_correction_scales_the_policy_gradient_as_the_weights_say(tiny_zoo):
    plain = _update(tiny_zoo, None, mode="none")
    same = _update(tiny_zoo, 0.0)
    assert "is_kl" not in plain
    assert same["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    assert same["is_abs_dlogp"] == pytest.approx(0.0, abs=1e-6) and same["is_capped_frac"] == 0.0

    # The engine gives every token a quarter of the trainer's probability: ratio 4, capped at 2 -> twice the gradient.
    gap = _update(tiny_zoo, -math.log(4))
    assert gap["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-4)
    assert gap["is_capped_frac"] == 1.0 and gap["is_abs_dlogp"] == pytest.approx(math.log(4), rel=1e-4)
    assert gap["is_kl"] == pytest.approx(4 - 1 - math.log(4), rel=1e-4)

    # The cap is the configured one, not the default's 2: at 1.5 the same gap gives 1.5 times the gradient.
    capped = _update(tiny_zoo, -math.log(4), cap=1.5)
    assert capped["grad_norm"] == pytest.approx(1.5 * plain["grad_norm"], rel=1e-4)

    # Below the cap the weight is the ratio itself: the engine's probabilities twice the trainer's -> half.
    half = _update(tiny_zoo, math.log(2))
    assert half["grad_norm"] == pytest.approx(0.5 * plain["grad_norm"], rel=1e-4)
    assert half["is_capped_frac"] == 0.0

    nan = _update(tiny_zoo, 0.0, nan_first=True)
    assert nan["is_nonfinite_tokens"] == 1 and math.isfinite(nan["grad_norm"]) and math.isfinite(nan["loss"])
    assert nan["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-6)  # that token left the loss


def test_the_weights_compare_the_engine_with_the_policy_at_rollout_time_in_every_pass(tiny_zoo):
    """algo.updates_per_batch=2: the second pass runs on weights the first changed, but the engine sampled from
    the rollout-time policy, so the weights stay min(pi_old / pi_engine, C): exactly 1 when the engine agrees
    with the trainer at rollout time, and the update equals the uncorrected one pass for pass (issue 23: weights
    from the current policy survived, as one pass cannot tell them apart)."""
    plain = _update(tiny_zoo, None, mode="none", passes=2)
    same = _update(tiny_zoo, 0.0, passes=2)
    assert same["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)  # the second pass's gradient
    assert same["loss"] == pytest.approx(plain["loss"], rel=1e-5)


def test_the_config_refuses_the_correction_with_truncated_sampling(tmp_path, tiny_zoo):
    from vlm_corl.config import ConfigError, config_from_dict

    cfg = {
        "members": [{"id": "a", "model": str(tiny_zoo["qwen3"])}],
        "reward": {"mode": "self_vote"},
        "algo": {"rollout_is": "token_truncated"},
        "rollout": {"top_p": 0.9},
    }
    with pytest.raises(ConfigError, match="set rollout.top_p=1.0 and rollout.top_k=0"):
        config_from_dict(cfg)


def test_token_mask_drops_tokens_over_the_cap_and_keeps_the_ratio_under_it(tiny_zoo):
    """token_mask, cap 2: every token at ratio 4 is over the cap and dropped (no gradient at all, every token and
    sequence counted as capped); at ratio 1.5 each keeps its weight 1.5: 1.5 times the plain gradient."""
    plain = _update(tiny_zoo, None, mode="none")
    over = _update(tiny_zoo, -math.log(4), mode="token_mask")
    assert over["grad_norm"] == 0.0 and over["loss"] == 0.0
    assert over["is_capped_frac"] == 1.0 and over["is_capped_seq_frac"] == 1.0
    under = _update(tiny_zoo, -math.log(1.5), mode="token_mask")
    assert under["grad_norm"] == pytest.approx(1.5 * plain["grad_norm"], rel=1e-4)
    assert under["is_capped_frac"] == 0.0 and under["is_capped_seq_frac"] == 0.0


@pytest.mark.parametrize(
    "mode, scaled, capped_seqs",
    [
        # ratio 2 per token: sequence ratios 2^4 = 16, 2^2 = 4, 2^3 = 8; cap 5
        ("sequence_truncated", (5.0, -4.0, 2.5), 2 / 3),  # weights min(R, 5) = 5, 4, 5 times (1, -1, 0.5)
        ("sequence_mask", (0.0, -4.0, 0.0), 2 / 3),  # 16 and 8 over the cap: dropped; 4 kept at weight 4
        ("token_truncated", (2.0, -2.0, 1.0), 0.0),  # per token: 2 each, under the cap
    ],
)
def test_sequence_weights_are_the_product_of_the_token_ratios(tiny_zoo, mode, scaled, capped_seqs):
    """The engine gives each token half the trainer's probability (ratio 2). A weight w on a sequence at ratio 1
    is the plain update with the advantage w A: the corrected update equals the plain one with the advantages
    scaled as the sequence weights say (the sequence modes' weights are products over 4, 2 and 3 tokens, the
    token mode's the token ratio). Masked: the tokens of the two dropped sequences, 7 of 9, count as capped."""
    corrected = _update(tiny_zoo, -math.log(2), mode=mode, cap=5.0)
    plain = _update(tiny_zoo, None, mode="none", advantages=scaled)
    assert corrected["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert corrected["loss"] == pytest.approx(plain["loss"], rel=1e-4)
    assert corrected["is_capped_seq_frac"] == pytest.approx(capped_seqs)
    assert corrected["is_capped_frac"] == pytest.approx(7 / 9 if mode.startswith("sequence") else 0.0)


def test_a_sequence_mode_leaves_out_a_sequence_whose_engine_log_prob_is_missing(tiny_zoo):
    """sequence_truncated with equal log-probs except one missing token in the first sequence: its ratio is
    unknown, so the whole sequence leaves the loss (the plain update without its advantage), and the missing
    token is counted."""
    corrected = _update(tiny_zoo, 0.0, nan_first=True, mode="sequence_truncated")
    plain = _update(tiny_zoo, None, mode="none", advantages=(0.0, -1.0, 0.5))
    assert corrected["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert corrected["is_nonfinite_tokens"] == 1

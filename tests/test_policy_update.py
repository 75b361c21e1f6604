"""The update every training step runs (`update.policy_update`), on a real tiny Qwen2-VL member and sequences
from a real HF rollout of rendered easy-vqa prompts (built as the loop builds them: `update_phase._sequences`,
`update_phase.batch_totals`).

Each update starts from the same weights and a fresh optimizer; `member.step` is wrapped on the instance to
snapshot the accumulated gradient (before clipping and the optimizer step) and the weights after the step,
so gradients are compared directly, not through Adam's non-linear parameter deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from vlm_corl.config import AlgoConfig, MemberConfig, TrainConfig
from vlm_corl.config.schema import RolloutConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.engines import make_engine
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.update import policy_update, response_logprobs
from vlm_corl.training.phases.update_phase import _sequences, batch_totals
from vlm_corl.training.rewards.grpo import group_advantages

CONST_NORM = 8  # Dr.GRPO's constant normaliser (rollout.max_new_tokens)
# Hand-chosen rewards of each slot's 3 groups x 3 responses; the middle group of slot 1 and the last of slot 2
# are constant: zero advantage (and filtered out under algo.filter_zero_variance).
REWARDS = (
    torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]),
    torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
)


@dataclass
class Slot:
    """One slot of the member: its rollout groups, rewards, GRPO advantages and per-response lengths."""

    groups: list
    rewards: torch.Tensor
    advantages: torch.Tensor = field(init=False)
    lengths: list[list[int]] = field(init=False)

    def __post_init__(self):
        self.advantages = group_advantages(self.rewards)
        self.lengths = [[len(r.token_ids) for r in g.responses] for g in self.groups]

    def sequences(self, filter_zero_variance: bool = False):
        cfg = SimpleNamespace(algo=AlgoConfig(filter_zero_variance=filter_zero_variance))
        return _sequences(self.groups, range(len(self.groups)), self.advantages, self.rewards, cfg)


@pytest.fixture(scope="module")
def setup(tiny_zoo):
    """(member, initial weights, [slot 1, slot 2]): two rollouts (3 prompts x K=3, up to 8 tokens) of one member,
    its two slots (as a member and its second view in co_rewarding_1). Extra end tokens, taken from a first
    sample, make the responses' lengths differ (padding in every micro-batch)."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])))
    render = Renderer(member, "original", 10**6, 10**6)
    examples = load_examples("easyvqa", split="train", limit=6).examples
    engine = make_engine("hf", member)
    eos = member.model.generation_config.eos_token_id
    params = SamplingParams(n=3, max_new_tokens=CONST_NORM, seed=1)
    first = [r.token_ids for g in engine.generate([render(e) for e in examples[:3]], params) for r in g.responses]
    member.model.generation_config.eos_token_id = member.eos_token_ids + [first[0][3], first[4][5]]
    try:
        slots = [
            Slot(engine.generate([render(e) for e in examples[i : i + 3]], params), r)
            for i, r in ((0, REWARDS[0]), (3, REWARDS[1]))
        ]
    finally:
        member.model.generation_config.eos_token_id = eos
    lengths = {n for s in slots for row in s.lengths for n in row}
    assert len(lengths) > 1, lengths  # padding is exercised
    initial = {k: v.clone() for k, v in member.model.state_dict().items()}
    return member, initial, slots


@dataclass
class Update:
    stats: dict
    grads: list[list[torch.Tensor]]  # per optimizer step: each parameter's accumulated gradient
    weights: list[dict[str, torch.Tensor]]  # per optimizer step: the weights after it


def update(setup, seqs, algo=None, totals=None, micro_batch_size=64, lr=1e-3, reference=None) -> Update:
    """One `policy_update` from the initial weights with a fresh optimizer, recording every optimizer step."""
    member, initial, _ = setup
    member.model.load_state_dict(initial)
    train = TrainConfig(lr=lr, micro_batch_size=micro_batch_size, warmup_ratio=0.0, grad_clip=0.0)
    member.setup_optimizer(train, 10)
    member.reference = reference
    out = Update({}, [], [])
    original = member.step

    def step(grad_clip, loss=None):  # snapshots around the real step
        out.grads.append([p.grad.detach().clone() for g in member.optimizer.param_groups for p in g["params"]])
        result = original(grad_clip, loss)
        out.weights.append({k: v.detach().clone() for k, v in member.model.state_dict().items()})
        return result

    member.step = step
    try:
        out.stats = policy_update(
            member, seqs, algo or AlgoConfig(), train, RolloutConfig(max_new_tokens=CONST_NORM), totals
        )
    finally:
        del member.step
        member.reference = None
    return out


def assert_grads_close(a, b, rtol=1e-5, atol=1e-7):
    """Per element within rtol, or atol (about 1e-6 of the largest gradient entries, ~0.07 here)."""
    assert len(a) == len(b)
    worst = max(float((x - y).abs().max() / (y.abs().max() + atol)) for x, y in zip(a, b))
    assert all(torch.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b)), f"worst relative gap {worst:.2e}"


def tokens(seqs) -> int:
    return sum(len(s.token_ids) for s in seqs)


def policy_logprobs(member, seqs, model=None):
    """(logp, mask) of `seqs` under `model` (default: the member's), as the update computes them."""
    return response_logprobs(
        model or member.model, [s.prompt_inputs for s in seqs], [s.token_ids for s in seqs], member.policy()
    )


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "drgrpo"])
def test_micro_batches_of_one_give_the_whole_batch_gradient(setup, loss_agg):
    """Gradient accumulation is exact: 9 sequences one per micro-batch (each its own full forward) accumulate
    the gradient and loss of one micro-batch of all 9 (the shared-prompt path), because every micro-batch's loss
    is normalised by the whole batch's totals, not its own (with its own, micro-batches of one would weigh a
    2-token response like an 8-token one under token_mean)."""
    seqs = setup[2][0].sequences()
    algo = AlgoConfig(loss_agg=loss_agg)
    one, whole = update(setup, seqs, algo, micro_batch_size=1), update(setup, seqs, algo)
    assert (len(one.grads), len(whole.grads)) == (1, 1)  # one optimizer step each
    assert_grads_close(one.grads[0], whole.grads[0])
    assert one.stats["loss"] == pytest.approx(whole.stats["loss"], rel=1e-5, abs=1e-7)
    assert one.stats["grad_norm"] == pytest.approx(whole.stats["grad_norm"], rel=1e-5)
    assert whole.stats["grad_norm"] > 0


def test_zero_advantage_sequences_are_skipped_but_counted_in_the_normaliser(setup):
    """Slot 1's middle group has rewards (1, 1, 1): advantage 0 for its 3 responses. They are skipped (6 of 9
    trained), and with the same totals passed the update is bit-identical (gradient and new weights) to the one
    on the 6 others alone. Without totals the normaliser still counts them: token_mean divides by all 9
    responses' tokens, so the gradient is that of the 6 alone (their own tokens) x tokens(6) / tokens(9)."""
    seqs = setup[2][0].sequences()
    nonzero = [s for s in seqs if s.advantage != 0.0]
    assert len(nonzero) == 6
    totals = (tokens(seqs), len(seqs))
    full = update(setup, seqs)
    alone = update(setup, nonzero, totals=totals)
    assert all(torch.equal(a, b) for a, b in zip(full.grads[0], alone.grads[0]))
    assert all(torch.equal(full.weights[0][k], alone.weights[0][k]) for k in full.weights[0])
    assert full.stats["trained_seqs"] == 6
    assert full.stats == alone.stats
    own = update(setup, nonzero)  # normalised by the 6 responses' tokens only
    scale = tokens(nonzero) / tokens(seqs)
    assert scale < 1
    assert_grads_close(full.grads[0], [g * scale for g in own.grads[0]])


def test_several_updates_per_batch_keep_the_first_pass_log_probs_as_old(setup):
    """algo.updates_per_batch=2: both passes use the log-probs computed before the first as pi_old. The first
    pass's ratio is exactly 1 (its gradient is the single-update one); after one step at lr 3e-2 the second
    pass's ratios leave [1 - 0.01, 1 + 0.01], and clip_frac counts, over 2 passes x all tokens, the tokens clipped:
    advantage > 0 with ratio > 1.01, or advantage < 0 with ratio < 0.99 (recomputed here from the weights the
    first step left). Were pi_old refreshed each pass, every ratio would be 1 and clip_frac 0."""
    member, _, slots = setup
    seqs = slots[0].sequences()
    algo = AlgoConfig(updates_per_batch=2, clip_low=0.01, clip_high=0.01)
    two = update(setup, seqs, algo, lr=3e-2)
    single = update(setup, seqs, AlgoConfig(clip_low=0.01, clip_high=0.01), lr=3e-2)
    assert len(two.grads) == 2
    assert_grads_close(two.grads[0], single.grads[0])
    assert not torch.allclose(two.grads[1][0], two.grads[0][0], rtol=1e-2)

    assert two.stats["trained_seqs"] == 9  # every sequence takes part when pi_old is needed
    member.model.load_state_dict(setup[1])
    with torch.no_grad():
        old, mask = policy_logprobs(member, seqs)
        member.model.load_state_dict(two.weights[0])
        new, _ = policy_logprobs(member, seqs)
    ratio = torch.exp(new - old)
    adv = torch.tensor([s.advantage for s in seqs])[:, None]
    clipped = ((adv > 0) & (ratio > 1.01)) | ((adv < 0) & (ratio < 0.99))
    count = int((clipped & mask.bool()).sum())
    assert count > 0 and (ratio - 1).abs().max() > 0.01
    assert two.stats["clip_frac"] == pytest.approx(count / (2 * tokens(seqs)), abs=1e-9)
    assert single.stats["clip_frac"] == 0.0  # one pass: ratio 1, nothing clipped


def noisy_reference(tiny_zoo) -> torch.nn.Module:
    """A KL anchor that differs from the member: the initial weights plus seeded noise (so a penalty and its
    gradient at the initial weights are not 0)."""
    reference = load_member(MemberConfig(id="ref", model=str(tiny_zoo["qwen2_vl"]), trainable=False)).model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return reference


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_adds_its_gradient_to_the_update(setup, tiny_zoo, estimator):
    """kl_beta=0.5 with a reference model (the member's initial weights plus seeded noise, so the penalty and
    its gradient at the current weights are not 0) adds exactly beta x the gradient of
    sum over trained tokens of k(logp, ref) / total tokens, with k1 = logp - ref and
    k3 = exp(ref - logp) - (ref - logp) - 1, computed here directly over all 9 sequences (the zero-advantage
    ones included: they carry KL)."""
    member, initial, slots = setup
    seqs = slots[0].sequences()
    reference = noisy_reference(tiny_zoo)
    beta = 0.5
    with_kl = update(setup, seqs, AlgoConfig(kl_beta=beta, kl_estimator=estimator), reference=reference)
    without = update(setup, seqs)

    member.model.load_state_dict(initial)
    member.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        ref, _ = policy_logprobs(member, seqs, model=reference)
    logp, mask = policy_logprobs(member, seqs)
    log_ratio = ref - logp
    k = -log_ratio if estimator == "k1" else torch.exp(log_ratio) - log_ratio - 1.0
    (beta * (k * mask).sum() / tokens(seqs)).backward()
    kl_grad = [p.grad for p in member.model.parameters() if p.requires_grad]
    difference = [a - b for a, b in zip(with_kl.grads[0], without.grads[0])]
    assert max(float(d.abs().max()) for d in difference) > 1e-3  # the penalty changed the update
    assert_grads_close(difference, kl_grad)


@pytest.mark.parametrize("filter_zero_variance", [False, True])
def test_a_members_slots_add_up_under_the_batch_totals(setup, filter_zero_variance):
    """The loop gives policy_update all of a member's slots' sequences with `batch_totals` over those slots.
    Slots 1 and 2: 9 responses each, 18 in all; filtering drops slot 1's middle group and slot 2's last (both
    constant), leaving 12. The totals equal the ones policy_update derives from the sequences themselves, and
    the update on both slots has the loss and gradient of the sum of the two slots' updates under those totals."""
    slots = setup[2]
    parts = [s.sequences(filter_zero_variance) for s in slots]
    both = parts[0] + parts[1]
    trained = [s for s in both if s.trained]
    assert len(trained) == (12 if filter_zero_variance else 18)
    totals = batch_totals([s.lengths for s in slots], [s.rewards for s in slots], filter_zero_variance)
    assert totals == (tokens(trained), len(trained))
    whole = update(setup, both, totals=totals)
    assert all(torch.equal(a, b) for a, b in zip(whole.grads[0], update(setup, both).grads[0]))
    first, second = (update(setup, p, totals=totals) for p in parts)
    assert whole.stats["loss"] == pytest.approx(first.stats["loss"] + second.stats["loss"], rel=1e-5, abs=1e-7)
    assert_grads_close(whole.grads[0], [a + b for a, b in zip(first.grads[0], second.grads[0])])
    assert whole.stats["trained_seqs"] == first.stats["trained_seqs"] + second.stats["trained_seqs"]


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_the_schedule_ends_at_the_configured_floor(tiny_zoo, floor):
    """train.min_lr_ratio away from its default 0.1: the cosine schedule goes from lr to floor x lr."""

    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])))
    m.setup_optimizer(TrainConfig(lr=1.0, min_lr_ratio=floor, warmup_ratio=0.0), 4)
    rates = []
    for _ in range(4):
        rates.append(m.optimizer.param_groups[0]["lr"])
        m.scheduler.step()
    assert rates[0] == pytest.approx(1.0) and m.optimizer.param_groups[0]["lr"] == pytest.approx(floor)
    assert rates == sorted(rates, reverse=True)

"""The update phase: one member's policy-gradient step on its own scored rollouts.

Members never share parameters, optimizer state or gradients: each call touches one member only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from vlm_corl.members.batching import (
    aligned_keys,
    collate,
    continuation,
    model_device,
    model_positions,
    on_device,
    prefill,
    response_mask,
)
from vlm_corl.members.rollout import Policy
from vlm_corl.training.rewards.grpo import (
    aggregate_loss,
    cispo_loss,
    clip_counts,
    clipped_surrogate,
    gspo_surrogate,
    kl_penalty,
    policy_entropy,
    rollout_is_weights,
    sapo_loss,
    selective_logprobs,
    token_stats,
)

if TYPE_CHECKING:
    from vlm_corl.config.schema import AlgoConfig, RolloutConfig, TrainConfig
    from vlm_corl.members.member import Member


@dataclass
class Sequence:
    """One response to train on: its prompt's processor tensors, its tokens and its advantage."""

    prompt_inputs: dict[str, torch.Tensor]
    token_ids: list[int]
    advantage: float
    trained: bool = True  # False: left out of the loss (algo.filter_zero_variance, algo.mask_truncated)
    rollout_logprobs: list[float] | None = None  # the engine's per-token log-probs (algo.rollout_is)


def response_logprobs(
    model: torch.nn.Module, prompt_inputs: list[dict], responses: list[list[int]], policy: Policy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of each response's tokens under `model` and `policy` (tempered like the rollout), and
    the mask (B, T).

    The policy is the distribution the rollout samples from: tempered, with the control tokens that
    generation suppresses removed. Log-probs on padding are 0. When prompts repeat (a GRPO group: the same
    dict object once per response), each distinct prompt and its images go through the model once and its
    responses continue from its KV cache (`batching.prefill`); gradients reach the prompt through the cache.
    Otherwise (or under gradient checkpointing, which drops caches) one pass over prompt + response, of which
    only the T positions that predict response tokens become logits (`logits_to_keep`).
    Memory: besides the model's logits, only row chunks are upcast (`grpo.selective_logprobs`), and the
    backward writes the logits' gradient over them.
    """
    logp, mask, _ = _logprobs_and_dtype(model, prompt_inputs, responses, policy)
    return logp, mask


@dataclass(frozen=True)
class Ran:
    """What a log-prob pass computed: its logits' dtype (the forward's compute dtype), the input positions its
    forward passes ran (padding included: it is computed too), the work behind `update_tokens`, and when asked
    the policy's token entropy (B, T) from the same logits (`grpo.policy_entropy`, no gradient), else None."""

    dtype: torch.dtype
    positions: int
    entropy: torch.Tensor | None = None


def _logprobs_and_dtype(model, prompt_inputs, responses, policy: Policy, entropy: bool = False):
    """`response_logprobs`, and what the passes ran (`Ran`; its entropy with `entropy`)."""
    dtypes, entropies = [], []

    # (B, t, V) logits -> (B, t) log-probs of the targets under the policy
    def policy_logp(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dtypes.append(logits.dtype)
        if entropy:  # before the log-probs: their backward writes its gradient over these logits
            entropies.append(policy_entropy(logits, policy.temperature, policy.suppressed))
        return selective_logprobs(logits, targets, policy.temperature, policy.suppressed, inplace_backward=True)

    logp, mask, positions = _per_position(model, prompt_inputs, responses, policy, policy_logp)
    # the shared-prompt path calls policy_logp for the first position, then the rest: the same order as its log-probs
    ran = Ran(dtypes[0], positions, torch.cat(entropies, dim=1) if entropy else None)
    # Padding targets are the (suppressed, -inf) pad token: zero them, or the masked loss is -inf * 0 = nan.
    return torch.where(mask.bool(), logp, 0.0), mask, ran


@torch.no_grad()
def response_token_stats(
    model: torch.nn.Module,
    prompt_inputs: list[dict],
    responses: list[list[int]],
    policy: Policy,
    micro_batch_size: int | None = None,
    passes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-response means of the policy's token entropy and self-certainty: (B,) each.

    The scoring pass for intrinsic rewards when the rollout engine did not record them (vLLM returns only
    top-k log-probs): like `response_logprobs` without gradients, `micro_batch_size` responses per forward
    (default: all at once), so at most one micro-batch of logits is alive. `passes` (at least the number of
    micro-batches) repeats the first micro-batch, discarded, until that many forwards ran: the ranks of a
    partitioned ZeRO-3 member must run the same number.
    """

    def stats(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (B, t, V) -> (B, t, 2)
        return torch.stack(token_stats(logits, policy.temperature, policy.suppressed), dim=-1)

    step = micro_batch_size or len(responses)
    starts = list(range(0, len(responses), step))
    means = []
    for n in range(max(passes or 0, len(starts))):
        i = starts[n] if n < len(starts) else 0
        values, mask, _ = _per_position(model, prompt_inputs[i : i + step], responses[i : i + step], policy, stats)
        lengths = mask.sum(dim=1).clamp(min=1)
        if n < len(starts):
            means.append(torch.where(mask.bool()[..., None], values, 0.0).sum(dim=1) / lengths[:, None])  # (b, 2)
    means = torch.cat(means)
    return {"entropy": means[:, 0], "self_certainty": means[:, 1]}


def _per_position(model, prompt_inputs, responses, policy: Policy, fn):
    """fn(logits, targets) at every response position, through the shared-prompt path when prompts repeat; the
    mask, and the input positions the forward passes ran (a shared prompt once, not once per response)."""
    # Checkpointed layers drop the cache (HF's GradientCheckpointingLayer), so they take the one-pass route.
    checkpointed = any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    # ZeRO-3 gathers weights in every forward: one pass per micro-batch keeps the ranks' passes in step (the
    # shared-prompt path skips its second pass for one-token responses).
    partitioned = hasattr(next(model.parameters()), "ds_id")
    distinct = len({id(p) for p in prompt_inputs})
    shared = distinct < len(prompt_inputs) and not (checkpointed or partitioned)
    values, mask = (_shared_prompt_logprobs if shared else _full_logprobs)(model, prompt_inputs, responses, policy, fn)
    prompt, t = max(p["input_ids"].shape[1] for p in prompt_inputs), mask.shape[1]
    # collated batches: prompts left-padded to the longest, responses right-padded; the shared path runs each
    # distinct prompt, then every response but its last token (the prompt's last position predicts the first)
    ran = distinct * prompt + len(responses) * (t - 1) if shared else len(responses) * (prompt + t)
    return values, mask, ran


def _full_logprobs(model, prompt_inputs, responses, policy: Policy, policy_logp):
    """One pass over prompt + response; only the T positions that predict response tokens become logits."""
    device = model_device(model)
    inputs, mask = collate(prompt_inputs, policy.pad_id, responses, aligned_keys(model))
    inputs, mask = on_device(inputs, device), mask.to(device)
    t, length = mask.shape[1], inputs["input_ids"].shape[1]
    inputs["position_ids"], _ = model_positions(model, inputs, policy.mrope)
    # Positions by index, not the last T+1 then [:, :-1]: slicing the logits would make the backward allocate
    # another logits-sized (zero-padded) gradient.
    keep = torch.arange(length - t - 1, length - 1, device=inputs["input_ids"].device)
    logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits  # (B, T, V)
    return policy_logp(logits, inputs["input_ids"][:, -t:]), mask


def _shared_prompt_logprobs(model, prompt_inputs, responses, policy: Policy, policy_logp):
    """Each distinct prompt run once: its last position predicts the first response token, and the responses
    (all but their last token) continue from its cache."""
    prefix = prefill(model, prompt_inputs, policy.pad_id, policy.mrope)
    device = prefix.last_logits.device
    mask = response_mask(responses, device)  # (B, T)
    t = mask.shape[1]
    targets = torch.tensor([r + [policy.pad_id] * (t - len(r)) for r in responses], device=device)  # (B, T)
    logp = policy_logp(prefix.last_logits[:, None], targets[:, :1])  # (B, 1)
    if t > 1:
        rest = model(**continuation(prefix, targets[:, :-1], mask[:, :-1])).logits  # (B, T-1, V)
        logp = torch.cat([logp, policy_logp(rest, targets[:, 1:])], dim=1)
    return logp, mask


def policy_update(
    member: Member,
    seqs: list[Sequence],
    algo: AlgoConfig,
    train: TrainConfig,
    rollout: RolloutConfig,
    totals: tuple[int, int] | None = None,
) -> dict:
    """One optimizer step of `member` on `seqs` (see `_policy_update`), inside the member's update context."""
    with member.updating():
        return _policy_update(member, seqs, algo, train, rollout, totals)


def _policy_update(member, seqs: list[Sequence], algo, train, rollout, totals: tuple[int, int] | None = None) -> dict:
    """One optimizer step of `member` on `seqs` (this rank's share of one rollout batch), in micro-batches,
    under `algo` and `train` (AlgoConfig, TrainConfig); `rollout` (RolloutConfig) gives the policy's
    temperature and Dr.GRPO's default constant normaliser (rollout.max_new_tokens).

    `totals` = (response tokens, responses) of the member's whole batch over all its ranks (default: `seqs`'
    own): the loss normaliser, so the ranks' losses and gradients add up to the full-batch ones (the member
    sums gradients over its ranks). With one update per rollout batch and no KL, the rollout policy is the
    current one: old log-probs are the current ones detached (no extra forward pass), and sequences with
    zero advantage contribute exactly zero loss, so they are skipped but still counted in the normaliser.
    Returns loss, grad_norm, lr, the clip fractions, kl, entropy (`update_stats`), trained_seqs, update_tokens,
    nonfinite_skipped (the optimizer steps skipped because the loss or the gradient norm was not finite),
    compute_dtype (this rank's logits') and with algo.rollout_is the mismatch figures (`rollout_mismatch`), all
    over the member's ranks but is_ratio_min / is_ratio_max: this rank's (the log phase takes them over the ranks,
    `step_metrics.member_stats`).
    """
    trained = [s for s in seqs if s.trained]
    totals = totals or (sum(len(s.token_ids) for s in trained), len(trained))
    need_all = algo.kl_beta > 0 or algo.updates_per_batch > 1
    work = trained if need_all else [s for s in trained if s.advantage != 0.0]
    micro, real = _micro_batches(member, work, seqs[0], train.micro_batch_size)
    member.model.train()
    old, sums = _old_logprobs(member, micro, algo, rollout, real)
    lr = member.lr  # the rate this step uses (the schedule advances inside member.step)
    policy = member.policy(rollout.temperature)
    loss_sum = torch.zeros((), dtype=torch.float64, device=member.device)
    grad_norm, skipped, ran, positions = 0.0, 0, None, 0  # ran: the last pass's (`Ran`); positions: all passes
    norm = (*totals, algo.drgrpo_norm or rollout.max_new_tokens)
    for n_pass in range(algo.updates_per_batch):
        for i, (mb, old_logp) in enumerate(zip(micro, old)):
            loss, _, _, mb_sums, ran = _micro_batch_loss(member, mb, old_logp, algo, policy, norm)
            positions += ran.positions
            if i < real:
                sums = add_sums(sums, mb_sums if n_pass == 0 else {k: mb_sums[k] for k in EVERY_PASS if k in mb_sums})
            else:  # a filler: runs the passes DeepSpeed's collectives expect, adds nothing
                loss = loss * 0.0
            member.backward(loss)
            loss_sum = loss_sum + loss.detach().double()
        grad_norm, applied = member.step(train.grad_clip, loss=loss_sum)
        skipped += not applied
    summed = _rank_sums(member, {"loss": loss_sum, **sums}, {"trained": len(work), "positions": positions})
    stats = {"loss": summed["loss"] / algo.updates_per_batch, "grad_norm": grad_norm, "lr": lr}
    stats.update(update_stats(summed, algo, totals))
    stats.update(
        trained_seqs=int(summed["trained"]),
        # input positions through the forward and backward passes, all ranks: the update's work (~6 x parameters
        # FLOPs per token), so its speed can be read against the device's; a prompt shared by a micro-batch's
        # responses ran once (`_per_position`), and every pass of algo.updates_per_batch counts
        update_tokens=int(summed["positions"]),
        nonfinite_skipped=skipped,  # optimizer steps the numerical guard skipped (Member.step)
        # what the forward computed in (bf16 under autocast, DeepSpeed's or ours); None: no micro-batch ran
        compute_dtype=None if ran is None else str(ran.dtype).removeprefix("torch."),
    )
    if algo.rollout_is != "none":
        stats.update(rollout_mismatch(summed))
    return stats


# The update's device-side sums of a micro-batch (`_micro_batch_loss`): the clip's counts and the KL to the
# reference add up over every pass of algo.updates_per_batch (like the loss); the entropy (`entropy_tokens`: the
# tokens it is over) and the off-policy mismatch sums (`MISMATCH_SUMS`) are of the rollout policy: the first pass.
EVERY_PASS = ("clip_low", "clip_high", "ref_kl")


def add_sums(sums: dict, more: dict) -> dict:
    """`sums` plus `more` (0-d device tensors, out of place): keys ending in _min / _max take the min / max."""
    out = dict(sums)
    for k, v in more.items():
        if k not in out:
            out[k] = v
        elif k.endswith("_min"):
            out[k] = torch.minimum(out[k], v)
        elif k.endswith("_max"):
            out[k] = torch.maximum(out[k], v)
        else:
            out[k] = out[k] + v
    return out


def update_stats(summed: dict, algo, totals: tuple[int, int]) -> dict:
    """The update's researcher-facing figures from its sums over the member's ranks (`_rank_sums`): clip_frac,
    clip_frac_low and clip_frac_high (`grpo.clip_counts` over the trained tokens, gspo: sequences, times the
    passes; None under sapo, which clips nothing), kl (mean `kl_estimator` value to the reference per trained
    token and pass; None without algo.kl_beta), entropy (the rollout policy's mean token entropy over the tokens
    the update ran a forward on, `_old_logprobs`; None when none ran) and with algo.rollout_is the importance
    weight before the cap over the finite response tokens (`grpo.rollout_is_weights`' ratio): is_ratio_mean, and
    this rank's is_ratio_min, is_ratio_max (None without such a token)."""
    passes = algo.updates_per_batch
    out = dict.fromkeys(("clip_frac", "clip_frac_low", "clip_frac_high"))
    if algo.policy_loss != "sapo":
        n = max((totals[1] if algo.policy_loss == "gspo" else totals[0]) * passes, 1)
        low, high = summed["clip_low"], summed["clip_high"]
        out.update(clip_frac=(low + high) / n, clip_frac_low=low / n, clip_frac_high=high / n)
    out["kl"] = summed["ref_kl"] / max(totals[0] * passes, 1) if algo.kl_beta > 0 else None
    counted = summed["entropy_tokens"]
    out["entropy"] = summed["entropy"] / counted if counted else None
    if algo.rollout_is != "none":
        seen = summed["tokens"] > 0  # finite response tokens
        out["is_ratio_mean"] = summed["ratio"] / summed["tokens"] if seen else None
        out["is_ratio_min"] = summed["ratio_min"] if seen else None  # this rank's: `step_metrics.member_stats`
        out["is_ratio_max"] = summed["ratio_max"] if seen else None
    return out


def _rank_sums(member, sums: dict[str, torch.Tensor], counts: dict[str, int]) -> dict:
    """The update's device sums (float64, 0-d) read in one host sync, then summed with the host `counts` over all
    the member's ranks in one collective; extremes (keys ending in _min / _max) stay this rank's."""
    values = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
    extremes = {k: v for k, v in values.items() if k.endswith(("_min", "_max"))}
    summed = member.sum_over_ranks({**{k: v for k, v in values.items() if k not in extremes}, **counts})
    return {**summed, **extremes}


def sequence_length(seq: Sequence) -> int:
    """Prompt plus response tokens: what one row of a micro-batch holds before padding."""
    return seq.prompt_inputs["input_ids"].shape[-1] + len(seq.token_ids)


def length_sorted(work: list[Sequence]) -> list[Sequence]:
    """`work` ordered so that micro-batches cut from it hold sequences of like length (less padding): groups
    (the responses sharing one prompt, kept together so that a micro-batch runs their prompt once) by their
    longest sequence, and each group's responses by length. The loss is the same in any order (every
    micro-batch's share is normalised by the whole batch's totals); only the padding, and so the time, differ."""
    groups: dict[int, list[Sequence]] = {}
    for seq in work:
        groups.setdefault(id(seq.prompt_inputs), []).append(seq)
    ordered = sorted(groups.values(), key=lambda group: max(map(sequence_length, group)))  # stable: ties keep order
    return [seq for group in ordered for seq in sorted(group, key=sequence_length)]


def _micro_batches(member, work: list[Sequence], any_seq: Sequence, size: int) -> tuple[list[list[Sequence]], int]:
    """`work` in micro-batches of `size` (on CUDA sorted by length: `length_sorted`), and how many of them are
    real: under DeepSpeed every rank of the member runs as many passes, so ranks with fewer get zero-loss fillers
    (a copy of `any_seq`)."""
    if member.device.type == "cuda":
        # Less padding is what a GPU's update time follows. On the CPU the order is kept: the same sums in the
        # same order as before, so CPU runs (the demo's published table, one process against its ranks) repeat.
        work = length_sorted(work)
    micro = [work[i : i + size] for i in range(0, len(work), size)]
    real = len(micro)
    return micro + [[replace(any_seq, advantage=0.0)]] * (member.micro_batch_count(real) - real), real


def _old_logprobs(member, micro: list[list[Sequence]], algo, rollout, real: int) -> tuple[list, dict]:
    """Per micro-batch, the rollout policy's log-probs, taken before the first of several updates on one rollout
    batch (algo.updates_per_batch > 1); else None each: the rollout policy is the current one, whose log-probs
    each micro-batch's pass gives (detached) with no extra forward pass. And the update's sums (`SUMS`) started:
    zeros, plus the policy's entropy over the first `real` micro-batches where this pass computed it."""
    zero = torch.zeros((), dtype=torch.float64, device=member.device)
    sums = {**dict.fromkeys(SUMS, zero), "ratio_min": zero + math.inf, "ratio_max": zero - math.inf}
    if algo.updates_per_batch <= 1:
        return [None] * len(micro), sums
    old = []
    with torch.no_grad():
        for i, mb in enumerate(micro):
            logp, mask, ran = _logprobs(member, mb, member.policy(rollout.temperature), entropy=i < real)
            old.append(logp)
            sums = add_sums(sums, _entropy_sums(ran, mask) if i < real else {})
    return old, sums


def _entropy_sums(ran: Ran, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """A pass's token entropy summed over its response tokens, and their count (float64 device tensors)."""
    return {"entropy": (ran.entropy * mask).sum().double(), "entropy_tokens": mask.sum().double()}


def _micro_batch_loss(member, mb: list[Sequence], old_logp, algo, policy: Policy, norm: tuple[int, int, int]):
    """One micro-batch's share of the loss (normalised by the whole batch's `norm` = (tokens, responses,
    Dr.GRPO constant)), its clipped-token mask, response mask, its sums for the update's figures (0-d float64
    device tensors: `grpo.clip_counts`' clip_low / clip_high, ref_kl with algo.kl_beta, the policy's entropy
    with `old_logp` None, the off-policy mismatch sums of `grpo.rollout_is_weights` with algo.rollout_is) and
    what its pass ran (`Ran`: its logits' dtype, its input positions). `old_logp` None: the rollout policy is
    the current one (its log-probs, detached; its entropy from this pass)."""
    logp, mask, ran = _logprobs(member, mb, policy, entropy=old_logp is None)
    sums = _entropy_sums(ran, mask) if old_logp is None else {}
    old_logp = logp.detach() if old_logp is None else old_logp
    adv = torch.tensor([s.advantage for s in mb], device=logp.device)
    token_loss, clipped = policy_token_loss(logp, old_logp, adv, mask, algo)
    sums["clip_low"], sums["clip_high"] = clip_counts(clipped, adv, mask, algo.policy_loss)
    if algo.rollout_is != "none":
        # The rollout engine sampled from its own copy of the policy (other kernels, precision): weigh each
        # token's policy-gradient term by pi_train / pi_rollout (per token or per sequence, truncated or masked
        # at C), pi_train at rollout time.
        weights, mismatch = rollout_is_weights(
            old_logp, _rollout_logp(mb, mask), mask, algo.rollout_is_cap, algo.rollout_is
        )
        token_loss, sums = token_loss * weights, {**sums, **mismatch}
    if algo.kl_beta > 0:
        with torch.no_grad():
            ref_logp = _logprobs(member, mb, policy, model=member.reference)[0]
        kl = kl_penalty(logp, ref_logp, algo.kl_estimator)
        token_loss = token_loss + algo.kl_beta * kl
        sums["ref_kl"] = (kl.detach() * mask).sum().double()
    loss = aggregate_loss(token_loss, mask, algo.loss_agg, total_tokens=norm[0], total_seqs=norm[1], const_norm=norm[2])
    return loss, clipped, mask, sums, ran


def policy_token_loss(logp, old_logp, adv, mask, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, T) policy loss of algo.policy_loss (`grpo.py`'s functions) and where its clip was active."""
    if algo.policy_loss == "grpo":
        return clipped_surrogate(logp, old_logp, adv, algo.clip_low, algo.clip_high)
    if algo.policy_loss == "gspo":
        return gspo_surrogate(logp, old_logp, adv, mask, algo.gspo_clip_low, algo.gspo_clip_high)
    if algo.policy_loss == "cispo":
        return cispo_loss(logp, old_logp, adv, algo.cispo_max_weight)
    if algo.policy_loss == "sapo":
        return sapo_loss(logp, old_logp, adv, algo.sapo_tau_pos, algo.sapo_tau_neg)
    raise ValueError(f"unknown algo.policy_loss {algo.policy_loss!r}")


def _rollout_logp(mb: list[Sequence], mask: torch.Tensor) -> torch.Tensor:
    """(B, T) the engine's log-probs of each sequence's tokens, 0 on padding; NaN where the engine gave none."""
    t = mask.shape[1]
    rows = [s.rollout_logprobs if s.rollout_logprobs is not None else [float("nan")] * len(s.token_ids) for s in mb]
    return torch.tensor([r + [0.0] * (t - len(r)) for r in rows], dtype=torch.float32, device=mask.device)


# what `grpo.rollout_is_weights` sums over a micro-batch, added up over a member's batch (its extremes ratio_min and
# ratio_max apart: `add_sums` takes their min and max)
MISMATCH_SUMS = ("tokens", "abs_dlogp", "kl", "capped", "nonfinite", "seqs", "capped_seqs", "ratio")
# every sum an update keeps on the device (`_micro_batch_loss`'s): the same keys on every rank of a member, whatever
# its micro-batches held, so that their one collective adds like with like
SUMS = ("clip_low", "clip_high", "ref_kl", "entropy", "entropy_tokens", *MISMATCH_SUMS)


def rollout_mismatch(sums: dict[str, float]) -> dict[str, float]:
    """The engine/trainer gap (from rollout_is_weights' sums over a member's batch), as logged in metrics.jsonl:
    per token, mean |delta log p|, KL(pi_rollout || pi_train) estimate and the share of tokens the cap truncated
    or masked; the share of sequences it touched (token modes: a token capped; sequence modes: the sequence's
    weight over the cap); the count of tokens whose engine log-prob was not finite (excluded from the loss)."""
    n = max(sums["tokens"], 1.0)
    return {
        "is_abs_dlogp": sums["abs_dlogp"] / n,
        "is_kl": sums["kl"] / n,
        "is_capped_frac": sums["capped"] / n,
        "is_capped_seq_frac": sums["capped_seqs"] / max(sums["seqs"], 1.0),
        "is_nonfinite_tokens": int(sums["nonfinite"]),
    }


def _logprobs(member, mb: list[Sequence], policy: Policy, model=None, entropy: bool = False):
    """(log-probs, mask, what the pass ran: `Ran`, with the token entropy when `entropy`) of a micro-batch under the
    member's training module (or `model`, the KL anchor)."""
    model = model if model is not None else member.train_module
    with member.autocast(model):
        return _logprobs_and_dtype(model, [s.prompt_inputs for s in mb], [s.token_ids for s in mb], policy, entropy)

"""GRPO maths as pure tensor functions: group advantages, the policy losses (GRPO's clipped surrogate, GSPO,
CISPO, SAPO), the rollout importance weights, KL estimators, loss aggregation, and the policy's per-token
log-probs, entropy and self-certainty (chunked over rows for large vocabularies). docs/method.md tables them.

Shapes: G groups (one per prompt) of K responses; B = G*K sequences of T response tokens.
Nothing here knows about models or members; `vlm_corl.members.update` feeds these functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "drgrpo")
POLICY_LOSSES = ("grpo", "gspo", "cispo", "sapo")
ROLLOUT_IS = ("none", "token_truncated", "token_mask", "sequence_truncated", "sequence_mask")
KL_ESTIMATORS = ("k1", "k3")


def group_advantages(rewards: Tensor, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """GRPO advantages A = (r - mean_group) / (std + eps).

    rewards: (G, K). `scale` picks the std: "group" (per group, GRPO), "batch" (one std over all rewards),
    "none" (Dr.GRPO: centre only, no division). std is the unbiased estimate, as in TRL and verl.
    """
    centered = rewards - rewards.mean(dim=-1, keepdim=True)  # (G, K)
    if scale == "group":
        return centered / (rewards.std(dim=-1, keepdim=True) + eps)
    if scale == "batch":
        return centered / (rewards.std() + eps)
    if scale == "none":
        return centered
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")


def nonzero_variance_groups(rewards: Tensor) -> Tensor:
    """(G,) bool: groups whose rewards are not all equal (the others carry no GRPO gradient)."""
    return (rewards.max(dim=-1).values - rewards.min(dim=-1).values) > 0


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO clipped policy-gradient loss per token, and where the clip was active (algo.policy_loss=grpo).

    loss_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A), r_t = pi_theta / pi_old of token t
    (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024, arXiv 2402.03300). A clipped token carries no gradient.
    logp, old_logp: (B, T) log-probs of the sampled tokens under the current / rollout policy.
    advantages: (B,) one advantage per sequence. Returns (loss (B, T), clipped (B, T) bool).
    The ratio is clipped to [1 - clip_low, 1 + clip_high] (asymmetric clipping, DAPO's clip-higher).
    """
    ratio = torch.exp(logp - old_logp)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def gspo_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """GSPO's clipped loss with one importance ratio per sequence (algo.policy_loss=gspo), on every token.

    s_i = (pi_theta(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean over y_i's tokens of log pi_theta - log pi_old),
    loss_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)
    (Group Sequence Policy Optimization, Zheng et al. 2025, arXiv 2507.18071, eq. 5-7; TRL's
    importance_sampling_level="sequence"). The length-normalised (geometric-mean) ratio stays near 1 whatever
    the length, so its clip range is small: the paper's is 3e-4 below and 4e-4 above. A clipped sequence carries
    no gradient; an unclipped one gives each token the gradient -A_i s_i / |y_i| d log pi_theta.
    mask: (B, T) 1 on response tokens (padding never enters s_i). Returns (loss (B, T): loss_i on each of
    sequence i's positions, so `aggregate_loss` with seq_mean_token_mean gives the paper's 1/G sum_i loss_i;
    clipped (B, T) bool: the sequence's clip was active).
    """
    m = mask.to(logp.dtype)
    log_s = ((logp - old_logp) * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)  # (B,)
    s = torch.exp(log_s)
    unclipped = -advantages * s
    clipped = -advantages * torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # (B,)
    return loss.unsqueeze(-1).expand_as(logp), (clipped > unclipped).unsqueeze(-1).expand_as(logp)


def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, max_weight: float, min_weight: float = 0.0
) -> tuple[Tensor, Tensor]:
    """CISPO: the clipped importance weight, held constant, times the policy gradient (algo.policy_loss=cispo).

    loss_t = -sg(clip(r_t, min_weight, max_weight)) A log pi_theta(y_t), r_t = pi_theta / pi_old
    (MiniMax-M1, arXiv 2506.13585, eq. 4-5: there clip(r, 1 - eps_low, 1 + eps_high) with no lower bound in
    practice; TRL's loss_type="cispo" caps at epsilon_high, 5 recommended after ScaleRL, arXiv 2510.13786).
    Unlike the PPO clip, no token is dropped: a token whose ratio passed the cap still gets the gradient
    -min(r_t, max_weight) A d log pi_theta. The loss's value is a log-likelihood, not comparable with the
    surrogates' (only its gradient is). Returns (loss (B, T), clipped (B, T) bool: the weight was bounded).
    """
    ratio = torch.exp(logp - old_logp).detach()
    weight = ratio.clamp(min=min_weight, max=max_weight)
    return -weight * advantages.unsqueeze(-1) * logp, weight != ratio


def sapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float
) -> tuple[Tensor, Tensor]:
    """SAPO: a smooth sigmoid gate of the ratio in place of the hard clip (algo.policy_loss=sapo).

    loss_t = -f(r_t) A, f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg
    (Soft Adaptive Policy Optimization, Gao et al. 2025, Qwen, arXiv 2511.20347; as TRL's loss_type="sapo",
    temperatures 1.0 and 1.05 by default there). Its gradient is -A 4 sigma (1 - sigma) r d log pi_theta: exactly
    the policy gradient at r = 1, fading smoothly (never cut) as r leaves 1, faster for the larger temperature,
    which the paper gives the negative advantages. Returns (loss (B, T), clipped (B, T): all False, nothing is
    clipped).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv, torch.zeros_like(ratio, dtype=torch.bool)


def clip_counts(clipped: Tensor, advantages: Tensor, mask: Tensor, policy_loss: str) -> tuple[Tensor, Tensor]:
    """(low, high): how often the objective's clip was active, at the level it clips, as 0-d float64 tensors.

    clipped: (B, T) bool, the objectives' second output; advantages: (B,); mask: (B, T) 1 on response tokens.
    grpo counts tokens, gspo sequences (its clip acts on one ratio per sequence); low: the ratio under the lower
    bound with A < 0, high: over the upper bound with A > 0 (a clip with the other sign never binds: the
    surrogate's min keeps the unclipped term), as TRL's clip_ratio/low_mean and high_mean. cispo counts tokens
    whose weight was capped: all high (no lower bound). sapo clips nothing: (0, 0).
    """
    active = clipped & mask.bool()
    if policy_loss == "gspo":
        active = active.any(dim=-1, keepdim=True)
    if policy_loss == "cispo":
        low, high = torch.zeros_like(active), active
    else:
        adv = advantages.view(-1, 1)
        low, high = active & (adv < 0), active & (adv > 0)
    return low.sum().double(), high.sum().double()


def rollout_is_weights(
    train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float, mode: str = "token_truncated"
) -> tuple[Tensor, dict]:
    """Importance weights for the gap between the policy the rollout engine sampled from (vLLM kernels, other
    precision) and the trainer's own (algo.rollout_is), and the mismatch figures.

    With r_t = pi_train / pi_rollout of token t and the cap C:
    - token_truncated: w_t = min(r_t, C) (truncated importance sampling, TIS: Yao et al. 2025, "Your efficient RL
      framework secretly brings you off-policy RL training"; TRL's token_truncate);
    - token_mask: w_t = r_t if r_t <= C else 0 (TRL's token_mask, verl's token-level masked IS);
    - sequence_truncated: every token of sequence i gets min(R_i, C), R_i = prod_t r_t = exp(sum_t log r_t);
    - sequence_mask: every token of sequence i gets R_i if R_i <= C else 0 (TRL's default, with C = 3).
    R_i is the product of the token ratios, as in TRL's and verl's sequence modes: the ratio of the two
    policies' probabilities of the whole sequence, which grows with the length (not GSPO's geometric mean).

    train_logp: (B, T) the trainer's log-probs of the sampled tokens at rollout time (detached);
    rollout_logp: (B, T) the engine's; mask: (B, T) 1 on response tokens. A token whose engine log-prob is not
    finite gets weight 0 (excluded), and in the sequence modes its whole sequence (R_i is unknown); it is
    counted. Returns (weights (B, T), sums (0-d float64 tensors on the weights' device, so that a caller adding
    them up over micro-batches reads them once, not each a host sync): tokens (finite response tokens), abs_dlogp
    (|log pi_train - log pi_rollout|) and kl (k3 estimate of KL(pi_rollout || pi_train): r - 1 - log r) over
    them, capped (those tokens whose weight the cap changed: truncated or zeroed; in the sequence modes the tokens
    of the capped sequences), nonfinite (tokens), seqs (sequences with a response token), capped_seqs (token
    modes: sequences with a capped token; sequence modes: sequences with R_i > C), ratio (the weight before the
    cap: r_t, or R_i on each of sequence i's tokens, summed over the finite tokens), and its extremes ratio_min /
    ratio_max over them (inf / -inf when there is none: a caller takes the min / max of these, not the sum)).
    """
    real = mask.bool()
    finite = torch.isfinite(rollout_logp) & real
    delta = torch.where(finite, train_logp - torch.where(finite, rollout_logp, 0.0), 0.0)
    ratio = delta.exp()
    log_cap = math.log(cap)
    if mode.startswith("token_"):
        over = finite & (delta > log_cap)
        kept = ratio.clamp(max=cap) if mode == "token_truncated" else torch.where(over, 0.0, ratio)
        weights = torch.where(finite, kept, 0.0)
        capped_seqs = over.any(dim=-1)
    elif mode.startswith("sequence_"):
        seq_delta = delta.sum(dim=-1, keepdim=True)  # (B, 1): log R_i over the finite tokens
        usable = ~(real & ~finite).any(dim=-1, keepdim=True)  # no token of the sequence lacks an engine log-prob
        above = seq_delta > log_cap
        seq_ratio = seq_delta.exp()  # may overflow to inf: then above holds and inf never reaches the weights
        kept = seq_ratio.clamp(max=cap) if mode == "sequence_truncated" else torch.where(above, 0.0, seq_ratio)
        weights = torch.where(finite & usable, kept, 0.0)
        over = finite & above & usable
        capped_seqs = (above & usable).squeeze(-1) & real.any(dim=-1)
    else:
        raise ValueError(f"mode must be one of {ROLLOUT_IS[1:]}, got {mode!r}")
    sums = {
        "tokens": finite.sum(),
        **_uncapped_ratio(delta, finite, mode),
        "abs_dlogp": delta.abs().sum(),
        "kl": torch.where(finite, ratio - 1.0 - delta, 0.0).sum(),
        "capped": over.sum(),
        "nonfinite": (real & ~finite).sum(),
        "seqs": real.any(dim=-1).sum(),
        "capped_seqs": capped_seqs.sum(),
    }
    return weights, {k: v.double() for k, v in sums.items()}


def _uncapped_ratio(delta: Tensor, finite: Tensor, mode: str) -> dict[str, Tensor]:
    """`rollout_is_weights`' ratio sums: the weight before the cap of each finite token (r_t = exp(delta_t), or
    in a sequence mode R_i on each of sequence i's), summed, and its min and max. In float64: R_i overflows
    float32 long before a mismatch large enough to matter."""
    raw = (delta if mode.startswith("token_") else delta.sum(dim=-1, keepdim=True)).double().exp()
    return {
        "ratio": torch.where(finite, raw, 0.0).sum(),
        "ratio_min": torch.where(finite, raw, math.inf).min(),
        "ratio_max": torch.where(finite, raw, -math.inf).max(),
    }


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi. (B, T) -> (B, T).

    k1 = log pi - log pi_ref (unbiased, high variance, can be negative);
    k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, non-negative, low variance; Schulman's estimator).
    """
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregate_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    const_norm: float | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar.

    "token_mean": sum over all valid tokens / number of valid tokens (DAPO, the default);
    "seq_mean_token_mean": mean over sequences of each sequence's token mean (original GRPO);
    "drgrpo": sum over valid tokens / (number of sequences * const_norm) (Dr.GRPO's constant normaliser).
    When a batch is split into micro-batches, pass the whole batch's `total_tokens` / `total_seqs`: the
    results of the micro-batches then add up to the full-batch loss (gradient accumulation stays exact).
    """
    mask = mask.to(token_loss.dtype)
    masked = token_loss * mask
    seqs = float(token_loss.shape[0]) if total_seqs is None else total_seqs
    if mode == "token_mean":
        tokens = mask.sum() if total_tokens is None else total_tokens
        return masked.sum() / max(float(tokens), 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)  # (B,)
        return per_seq.sum() / seqs
    if mode == "drgrpo":
        if const_norm is None:
            raise ValueError("drgrpo aggregation needs const_norm (e.g. the max response length)")
        return masked.sum() / (seqs * const_norm)
    raise ValueError(f"mode must be one of {LOSS_AGGS}, got {mode!r}")


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each next-token distribution. (..., V) -> (...). Tokens at -inf (suppressed) count as 0."""
    return _entropy(torch.log_softmax(logits.float(), dim=-1))


def token_self_certainty(logits: Tensor) -> Tensor:
    """KL(U || p) of each next-token distribution, U uniform over the samplable tokens. (..., V) -> (...).

    Intuitor's self-certainty: KL(U || p) = -log V' - mean_v log p_v over the V' tokens not at -inf
    (suppressed control tokens are not part of the policy's choices); zero for a uniform p.
    """
    return _self_certainty(torch.log_softmax(logits.float(), dim=-1))


def _entropy(logp: Tensor) -> Tensor:
    return -torch.where(torch.isfinite(logp), logp.exp() * logp, 0.0).sum(dim=-1)


def _self_certainty(logp: Tensor) -> Tensor:
    finite = torch.isfinite(logp)
    count = finite.sum(dim=-1).clamp(min=1)
    mean_logp = torch.where(finite, logp, 0.0).sum(dim=-1) / count
    return -mean_logp - torch.log(count.float())


# Policy statistics over a full vocabulary, row chunk by row chunk. A (B, T, V) fp32 copy of the logits is
# 2x their bf16 size and the unchunked maths makes several, so only one chunk of rows is ever upcast.
CHUNK_ELEMENTS = 1 << 23  # fp32 elements per chunk (32 MiB) when chunk_rows is not given


def selective_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    suppressed: Sequence[int] = (),
    chunk_rows: int | None = None,
    inplace_backward: bool = False,
) -> Tensor:
    """log pi(target) under the policy of `logits`: tempered, `suppressed` ids removed. (..., V), (...) -> (...) fp32.

    Equals log_softmax(logits.float() / temperature with suppressed ids at -inf).gather(targets) (a suppressed
    target gets -inf), but only `chunk_rows` rows at a time are upcast, and backward saves the logits
    themselves plus one float per row, recomputing each chunk's softmax. With `inplace_backward` the gradient
    is written over the logits (contiguous non-leaf ones only; they must not be used after backward): the
    backward then needs no second logits-sized buffer.
    """
    how = (float(temperature), tuple(suppressed), chunk_rows or max(1, CHUNK_ELEMENTS // logits.shape[-1]))
    return _SelectiveLogprobs.apply(logits, targets, how, inplace_backward)


@torch.no_grad()
def token_stats(
    logits: Tensor, temperature: float = 1.0, suppressed: Sequence[int] = (), chunk_rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """(`token_entropy`, `token_self_certainty`) of the policy of `logits` (tempered, `suppressed` ids removed),
    (..., V) -> (...) each, computed `chunk_rows` rows at a time. No gradients."""
    entropy, certainty = _chunked(logits, (temperature, tuple(suppressed), chunk_rows), (_entropy, _self_certainty))
    return entropy, certainty


@torch.no_grad()
def policy_entropy(
    logits: Tensor, temperature: float = 1.0, suppressed: Sequence[int] = (), chunk_rows: int | None = None
) -> Tensor:
    """`token_entropy` of the policy of `logits` (tempered, `suppressed` ids removed), (..., V) -> (...) fp32,
    `chunk_rows` rows at a time: the update's `entropy` metric from its own forward's logits, never a (..., V)
    fp32 copy of them. No gradients."""
    return _chunked(logits, (temperature, tuple(suppressed), chunk_rows), (_entropy,))[0]


def _chunked(logits: Tensor, how: tuple, fns: tuple) -> list[Tensor]:
    """Each of `fns` (fp32 log-probs (rows, V) -> (rows,)) over the policy of `logits`, how = (temperature,
    suppressed ids, chunk rows or None), one chunk of rows upcast at a time; (...) each."""
    temperature, suppressed, chunk_rows = how
    rows, ids = _rows(logits), _suppressed_ids(suppressed, logits.device)
    out = torch.empty(len(fns), rows.shape[0], device=logits.device)
    for s, e in _spans(rows.shape[0], chunk_rows or max(1, CHUNK_ELEMENTS // logits.shape[-1])):
        logp = torch.log_softmax(_policy_chunk(rows[s:e], temperature, ids), dim=-1)
        for i, fn in enumerate(fns):
            out[i, s:e] = fn(logp)
    return [o.view(logits.shape[:-1]) for o in out]


def _rows(logits: Tensor) -> Tensor:
    return logits.reshape(-1, logits.shape[-1])  # a view when contiguous (the model's own logits are)


def _spans(n: int, size: int):
    return ((s, min(s + size, n)) for s in range(0, n, size))


def _suppressed_ids(suppressed: tuple, device: torch.device) -> Tensor | None:
    """The suppressed token ids on `device`, once per call of a chunked function (a host-to-device copy waits for
    the device: once per chunk would be a host sync per chunk); None for none."""
    return torch.tensor(suppressed, device=device) if suppressed else None


def _policy_chunk(chunk: Tensor, temperature: float, ids: Tensor | None, writable: bool = False) -> Tensor:
    """fp32 logits of the sampling distribution for a (rows, V) chunk, as `update` defines it (the same ops); `ids`:
    the suppressed ids (`_suppressed_ids`).

    `writable`: the result is never `chunk`'s memory, so the caller may work on it in place. Each step works in
    place on a copy the step before made (the upcast of bf16 logits, the tempering): a bf16 chunk costs one
    fp32 copy, not three.
    """
    x = chunk.float()
    if temperature != 1.0:
        x = x / temperature
    owned = x.data_ptr() != chunk.data_ptr()
    if ids is not None:
        x = x.index_fill_(-1, ids, float("-inf")) if owned else x.index_fill(-1, ids, float("-inf"))
        owned = True
    return x if owned or not writable else x.clone()


class _SelectiveLogprobs(torch.autograd.Function):
    """Chunked log pi(target); see `selective_logprobs`. Saves the logits and log-normalisers (N,), not the
    softmax: d logp_t / d logits = (onehot(t) - softmax) / temperature is recomputed chunk by chunk."""

    @staticmethod
    def forward(
        ctx, logits: Tensor, targets: Tensor, how: tuple[float, tuple[int, ...], int], inplace_backward: bool
    ) -> Tensor:  # how: (temperature, suppressed ids, chunk rows)
        temperature, suppressed, chunk_rows = how
        rows, index, ids = _rows(logits), targets.reshape(-1, 1), _suppressed_ids(suppressed, logits.device)
        logp = torch.empty(rows.shape[0], device=logits.device)
        log_norm = torch.empty_like(logp)
        with torch.autocast(logits.device.type, enabled=False):
            for s, e in _spans(rows.shape[0], chunk_rows):
                x = _policy_chunk(rows[s:e], temperature, ids, writable=True)
                top = x.amax(dim=-1, keepdim=True)
                picked = x.gather(-1, index[s:e])
                # the order of log_softmax's own kernel (shift by the max, then log-sum-exp): equal results
                log_sum = torch.log(x.sub_(top).exp_().sum(dim=-1, keepdim=True))
                logp[s:e] = ((picked - top) - log_sum).squeeze(-1)
                log_norm[s:e] = (top + log_sum).squeeze(-1)
        ctx.save_for_backward(logits, targets, log_norm)
        ctx.args = how
        ctx.inplace = inplace_backward and logits.is_contiguous() and not logits.is_leaf
        return logp.view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor) -> tuple[Tensor, None, None, None]:
        logits, targets, log_norm = ctx.saved_tensors
        temperature, suppressed, chunk_rows = ctx.args
        rows, index, ids = _rows(logits), targets.reshape(-1, 1), _suppressed_ids(suppressed, logits.device)
        grad = rows if ctx.inplace else torch.empty_like(rows)
        scale = grad_logp.reshape(-1, 1).float() / temperature  # (N, 1)
        with torch.autocast(logits.device.type, enabled=False):
            for s, e in _spans(rows.shape[0], chunk_rows):
                probs = _policy_chunk(rows[s:e], temperature, ids, writable=True).sub_(log_norm[s:e, None]).exp_()
                grad[s:e] = probs.mul_(-scale[s:e]).scatter_add_(-1, index[s:e], scale[s:e])
        return grad.view(logits.shape), None, None, None

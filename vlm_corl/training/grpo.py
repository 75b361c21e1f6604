"""GRPO maths as pure tensor functions: group advantages, the clipped surrogate, KL estimators, loss aggregation,
and the policy's per-token log-probs, entropy and self-certainty (chunked over rows for large vocabularies).

Shapes: G groups (one per prompt) of K responses; B = G*K sequences of T response tokens.
Nothing here knows about models or members; `vlm_corl.members.update` feeds these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

SCALES = ("group", "batch", "none")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "drgrpo")
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
    """PPO clipped policy-gradient loss per token, and where the clip was active.

    logp, old_logp: (B, T) log-probs of the sampled tokens under the current / rollout policy.
    advantages: (B,) one advantage per sequence. Returns (loss (B, T), clipped (B, T) bool).
    The ratio is clipped to [1 - clip_low, 1 + clip_high] (asymmetric clipping, DAPO's clip-higher).
    """
    ratio = torch.exp(logp - old_logp)  # (B, T)
    adv = advantages.unsqueeze(-1)  # (B, 1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def truncated_is_weights(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, dict]:
    """Token-level truncated importance weights min(pi_train / pi_rollout, cap) for the gap between the policy
    the rollout engine sampled from (vLLM kernels, other precision) and the trainer's own, and the mismatch.

    train_logp: (B, T) the trainer's log-probs of the sampled tokens at rollout time (detached);
    rollout_logp: (B, T) the engine's; mask: (B, T) 1 on response tokens. A token whose engine log-prob is not
    finite gets weight 0 (excluded) and is counted. Returns (weights (B, T), sums over the finite tokens:
    tokens, abs_dlogp (|log pi_train - log pi_rollout|), kl (k3 estimate of KL(pi_rollout || pi_train) from the
    rollout's samples: r - 1 - log r with r = pi_train / pi_rollout), capped (tokens with r > cap), nonfinite).
    """
    real = mask.bool()
    finite = torch.isfinite(rollout_logp) & real
    delta = torch.where(finite, train_logp - torch.where(finite, rollout_logp, 0.0), 0.0)
    ratio = delta.exp()
    weights = torch.where(finite, ratio.clamp(max=cap), 0.0)
    sums = {
        "tokens": float(finite.sum()),
        "abs_dlogp": float(delta.abs().sum()),
        "kl": float(torch.where(finite, ratio - 1.0 - delta, 0.0).sum()),
        "capped": float((finite & (ratio > cap)).sum()),
        "nonfinite": float((real & ~finite).sum()),
    }
    return weights, sums


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
    rows = _rows(logits)
    out = torch.empty(2, rows.shape[0], device=logits.device)
    for s, e in _spans(rows.shape[0], chunk_rows or max(1, CHUNK_ELEMENTS // logits.shape[-1])):
        logp = torch.log_softmax(_policy_chunk(rows[s:e], temperature, suppressed), dim=-1)
        out[0, s:e], out[1, s:e] = _entropy(logp), _self_certainty(logp)
    return out[0].view(logits.shape[:-1]), out[1].view(logits.shape[:-1])


def _rows(logits: Tensor) -> Tensor:
    return logits.reshape(-1, logits.shape[-1])  # a view when contiguous (the model's own logits are)


def _spans(n: int, size: int):
    return ((s, min(s + size, n)) for s in range(0, n, size))


def _policy_chunk(chunk: Tensor, temperature: float, suppressed: tuple, writable: bool = False) -> Tensor:
    """fp32 logits of the sampling distribution for a (rows, V) chunk, as `update` defines it (the same ops).

    `writable`: the result is never `chunk`'s memory, so the caller may work on it in place. Each step works in
    place on a copy the step before made (the upcast of bf16 logits, the tempering): a bf16 chunk costs one
    fp32 copy, not three.
    """
    x = chunk.float()
    if temperature != 1.0:
        x = x / temperature
    owned = x.data_ptr() != chunk.data_ptr()
    if suppressed:
        ids = torch.tensor(suppressed, device=x.device)
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
        rows, index = _rows(logits), targets.reshape(-1, 1)
        logp = torch.empty(rows.shape[0], device=logits.device)
        log_norm = torch.empty_like(logp)
        with torch.autocast(logits.device.type, enabled=False):
            for s, e in _spans(rows.shape[0], chunk_rows):
                x = _policy_chunk(rows[s:e], temperature, suppressed, writable=True)
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
        rows, index = _rows(logits), targets.reshape(-1, 1)
        grad = rows if ctx.inplace else torch.empty_like(rows)
        scale = grad_logp.reshape(-1, 1).float() / temperature  # (N, 1)
        with torch.autocast(logits.device.type, enabled=False):
            for s, e in _spans(rows.shape[0], chunk_rows):
                probs = (
                    _policy_chunk(rows[s:e], temperature, suppressed, writable=True).sub_(log_norm[s:e, None]).exp_()
                )
                grad[s:e] = probs.mul_(-scale[s:e]).scatter_add_(-1, index[s:e], scale[s:e])
        return grad.view(logits.shape), None, None, None

"""GRPO maths as pure tensor functions: group advantages, the clipped surrogate, KL estimators, loss aggregation.

Shapes: G groups (one per prompt) of K responses; B = G*K sequences of T response tokens.
Nothing here knows about models or members; `vlm_corl.update` feeds these functions.
"""

from __future__ import annotations

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
    logp = torch.log_softmax(logits.float(), dim=-1)
    p_logp = torch.where(torch.isfinite(logp), logp.exp() * logp, torch.zeros_like(logp))
    return -p_logp.sum(dim=-1)


def token_self_certainty(logits: Tensor) -> Tensor:
    """KL(U || p) of each next-token distribution, U uniform over the samplable tokens. (..., V) -> (...).

    Intuitor's self-certainty: KL(U || p) = -log V' - mean_v log p_v over the V' tokens not at -inf
    (suppressed control tokens are not part of the policy's choices); zero for a uniform p.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    finite = torch.isfinite(logp)
    count = finite.sum(dim=-1).clamp(min=1)
    mean_logp = torch.where(finite, logp, torch.zeros_like(logp)).sum(dim=-1) / count
    return -mean_logp - torch.log(count.float())

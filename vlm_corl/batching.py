"""Collate per-prompt processor outputs into model batches, for generation and for the policy forward pass.

Each prompt is processed once, alone (batch dim 1), at render time; images are never re-preprocessed.
Batches put prompts left-padded to a common length and, for the update, the response tokens after them,
right-padded, so the last T+1 logits cover every response (`logits_to_keep`).
"""

from __future__ import annotations

import torch
from torch import Tensor

# Processor outputs laid out along the token axis (dim 1); everything else is per image and is concatenated
# along dim 0 (flattened patches for Qwen-VL, (1, images, tiles, …) pixel tensors for Mllama, …).
SEQ_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "cross_attention_mask")


def _pad_value(key: str, pad_id: int) -> int:
    return pad_id if key == "input_ids" else 0


def collate(
    prompts: list[dict[str, Tensor]], pad_id: int, responses: list[list[int]] | None = None
) -> tuple[dict[str, Tensor], Tensor | None]:
    """Stack prompts (optionally each followed by its response) into one batch.

    prompts[i]: processor output of one prompt (batch dim 1); the same dict may appear K times, once per
    response. Returns (inputs, response_mask): inputs hold (B, L + T) token tensors with prompts left-padded
    to L and responses right-padded to T; response_mask is (B, T) with 1 on real response tokens (None when
    no responses are given).
    """
    longest = max(p["input_ids"].shape[1] for p in prompts)
    t_max = max((len(r) for r in responses), default=0) if responses is not None else 0
    out: dict[str, Tensor] = {}
    for key in prompts[0]:
        values = [p[key] for p in prompts]
        if key not in SEQ_KEYS:
            out[key] = torch.cat(values, dim=0)
            continue
        rows = []
        for i, v in enumerate(values):
            left = longest - v.shape[1]
            pad = v.new_full((1, left, *v.shape[2:]), _pad_value(key, pad_id))
            parts = [pad, v]
            if responses is not None:
                parts.append(_response_part(key, v, responses[i], t_max, pad_id))
            rows.append(torch.cat(parts, dim=1))
        out[key] = torch.cat(rows, dim=0)
    if responses is None:
        return out, None
    mask = torch.zeros(len(responses), t_max, dtype=torch.long)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1
    return out, mask


def _response_part(key: str, prompt_value: Tensor, response: list[int], t_max: int, pad_id: int) -> Tensor:
    """The (1, t_max, …) continuation of one token-axis tensor over a response and its right padding."""
    n = len(response)
    if key == "input_ids":
        ids = response + [pad_id] * (t_max - n)
        return torch.tensor([ids], dtype=prompt_value.dtype)
    if key == "attention_mask":
        return torch.tensor([[1] * n + [0] * (t_max - n)], dtype=prompt_value.dtype)
    if key == "cross_attention_mask":
        # Generated tokens attend to the same images as the last prompt token (as Mllama's generate does).
        return prompt_value[:, -1:].expand(1, t_max, *prompt_value.shape[2:])
    return prompt_value.new_zeros((1, t_max, *prompt_value.shape[2:]))  # token-type ids: text tokens


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, matching what `generate` uses, so training and rollout agree."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

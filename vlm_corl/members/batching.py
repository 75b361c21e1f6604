"""Collate per-prompt processor outputs into model batches, for generation and for the policy forward pass.

Each prompt is processed once, alone (batch dim 1), at render time; images are never re-preprocessed. Rendered
prompts live on the host (a Qwen2.5-VL image is ~24 MB of fp32 pixels): a batch is collated there and moved to
the model's device as a whole, only while a rollout or a micro-batch uses it (`on_device`). Batches put prompts
left-padded to a common length and, for the update, the response tokens after them, right-padded, so the last
T+1 logits cover every response (`logits_to_keep`).

A prompt shared by K responses is run through the model once (`prefill`): its KV cache (vision and
cross-attention states included) is then repeated to one row per response, and the responses continue from it
(`continuation`). Rollout and update both work this way, so neither encodes a prompt or its images K times.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlm_corl.members.kv_cache import cache_argument, reserve_cache, select_cache_rows

# Processor outputs laid out along the token axis (dim 1); everything else is per image and is concatenated
# along dim 0 (flattened patches for Qwen-VL, …), except a family's batch-aligned keys (Mllama's
# (1, images, tiles, …) pixel tensors), which get one row per prompt.
SEQ_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "cross_attention_mask")


@functools.cache
def _aligned_for(model_type: str) -> tuple[str, ...]:
    from vlm_corl.members.families import family_for_model_type

    try:
        return family_for_model_type(model_type).batch_aligned_keys
    except ValueError:  # a member whose family was set by hand: per-image inputs, the common layout
        return ()


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model itself (a DeepSpeed engine wraps it as `.module`)."""
    return getattr(model, "module", model)


def aligned_keys(model: torch.nn.Module) -> tuple[str, ...]:
    """The batch-aligned image inputs of `model`'s family (see Family.batch_aligned_keys)."""
    return _aligned_for(getattr(getattr(unwrapped(model), "config", None), "model_type", ""))


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: a DeepSpeed engine's device, else its parameters' (ZeRO-3 placeholders included)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def on_device(inputs: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """A collated batch moved to `device` (a no-op for tensors already there)."""
    return {k: v.to(device) for k, v in inputs.items()}


def _pad_value(key: str, pad_id: int) -> int:
    return pad_id if key == "input_ids" else 0


def collate(
    prompts: list[dict[str, Tensor]],
    pad_id: int,
    responses: list[list[int]] | None = None,
    aligned: tuple[str, ...] = (),
) -> tuple[dict[str, Tensor], Tensor | None]:
    """Stack prompts (optionally each followed by its response) into one batch.

    prompts[i]: processor output of one prompt (batch dim 1); the same dict may appear K times, once per
    response. Returns (inputs, response_mask): inputs hold (B, L + T) token tensors with prompts left-padded
    to L and responses right-padded to T; response_mask is (B, T) with 1 on real response tokens (None when
    no responses are given). Prompts may differ in their image inputs (some have none): per-image inputs are
    concatenated over the prompts that have them; `aligned` keys (one row per prompt) are zero-filled for
    prompts without images and zero-padded to the largest image and tile counts, as the processor pads a batch.
    """
    longest = max(p["input_ids"].shape[1] for p in prompts)
    lengths = [p["input_ids"].shape[1] for p in prompts]
    t_max = max((len(r) for r in responses), default=0) if responses is not None else 0
    out: dict[str, Tensor] = {}
    for key in dict.fromkeys(k for p in prompts for k in p):  # every key, in first-seen order
        values = [p.get(key) for p in prompts]
        if key in aligned:
            values = _aligned_rows(values, key, lengths)
        elif key in SEQ_KEYS:  # a token-axis key only some prompts have (token types): absent is plain text, 0
            values = [
                p["input_ids"].new_zeros(p["input_ids"].shape) if v is None else v for p, v in zip(prompts, values)
            ]
        else:
            values = [v for v in values if v is not None]
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
    return out, response_mask(responses, out["input_ids"].device)


def _aligned_rows(values: list[Tensor | None], key: str, lengths: list[int]) -> list[Tensor]:
    """One row per prompt of a batch-aligned image input: zeros where a prompt has none, and every row
    zero-padded to the largest size of each image axis (the token axis of a SEQ key stays the prompt's own)."""
    present = [v for v in values if v is not None]
    first = 2 if key in SEQ_KEYS else 1
    sizes = [max(v.shape[d] for v in present) for d in range(first, present[0].dim())]
    rows = []
    for v, n in zip(values, lengths):
        row = present[0].new_zeros((1, n, *sizes) if key in SEQ_KEYS else (1, *sizes))
        if v is not None:
            row[tuple(slice(0, s) for s in v.shape)] = v
        rows.append(row)
    return rows


def _response_part(key: str, prompt_value: Tensor, response: list[int], t_max: int, pad_id: int) -> Tensor:
    """The (1, t_max, …) continuation of one token-axis tensor over a response and its right padding."""
    n = len(response)
    if key == "input_ids":
        ids = response + [pad_id] * (t_max - n)
        return torch.tensor([ids], dtype=prompt_value.dtype, device=prompt_value.device)
    if key == "attention_mask":
        return torch.tensor([[1] * n + [0] * (t_max - n)], dtype=prompt_value.dtype, device=prompt_value.device)
    if key == "cross_attention_mask":
        # Generated tokens attend to the same images as the last prompt token (as Mllama's generate does).
        return prompt_value[:, -1:].expand(1, t_max, *prompt_value.shape[2:])
    return prompt_value.new_zeros((1, t_max, *prompt_value.shape[2:]))  # token-type ids: text tokens


def response_mask(responses: list[list[int]], device: torch.device) -> Tensor:
    """(B, T) 1 on each response's tokens, 0 on the right padding up to the longest."""
    lengths = [len(r) for r in responses]
    # T from the host's lengths: reading it back from the device would wait for its queue (a sync per micro-batch)
    return (torch.arange(max(lengths), device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).long()


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, matching what `generate` uses, so training and rollout agree."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def model_positions(
    model: torch.nn.Module, inputs: dict[str, Tensor], mrope: bool, prompts: list[dict[str, Tensor]] | None = None
) -> tuple[Tensor, Tensor | None]:
    """Position ids of a collated batch, and for M-RoPE models (Qwen-VL) each row's (B, 1) text offset.

    M-RoPE positions come from the model's own `get_rope_index` (3-D for image tokens, padding skipped), as
    `generate` computes them; text-only rows get plain positions there too (the model left alone would count
    the left padding). `prompts`: the processor outputs `inputs` collates, prompts only (no responses): a batch
    of prompts whose positions are remembered (`remember_positions`, at render time) is assembled from them
    without calling `get_rope_index`, a Python loop over rows and their images (8 % of a step on a tiny model,
    and host syncs on a GPU); otherwise each row's positions are remembered now.
    """
    if not mrope:
        return position_ids(inputs["attention_mask"]), None
    if prompts is not None:
        known = _remembered_rows(model, prompts, inputs["input_ids"].shape[1])
        if known is not None:
            return tuple(t.to(inputs["input_ids"].device) for t in known)
    pos, delta = unwrapped(model).model.get_rope_index(
        **{k: v for k, v in inputs.items() if not k.startswith("pixel_values")}
    )
    if prompts is not None:
        _remember_rows(model, prompts, pos, delta)
    return pos, delta


# (id(model), id(prompt input_ids)) -> (a weak reference to those input_ids, (3, n) positions, (1,) offset).
# An entry goes when its prompt's input_ids are freed, so a rendered prompt's positions cost nothing past it.
_ROPE_ROWS: dict[tuple[int, int], tuple[weakref.ref, Tensor, Tensor]] = {}


def remember_positions(model: torch.nn.Module, prompt: dict[str, Tensor], mrope: bool) -> int:
    """Compute one rendered prompt's M-RoPE positions now (on the host, where it lives: in the renderer's
    background thread during training) and remember them for as long as the prompt lives, so no rollout or
    update computes them again. Returns the bytes they hold (0 without M-RoPE or without a model here)."""
    if not mrope or model is None:
        return 0
    model_positions(model, collate([prompt], 0)[0], True, [prompt])
    _, pos, delta = _ROPE_ROWS[(id(model), id(prompt["input_ids"]))]
    return pos.numel() * pos.element_size() + delta.numel() * delta.element_size()


def _remember_rows(model: torch.nn.Module, prompts: list[dict[str, Tensor]], pos: Tensor, delta: Tensor) -> None:
    """Keep row b's positions: the last n_b columns (collate left-pads; a row does not depend on the others)."""
    for b, prompt in enumerate(prompts):
        ids = prompt["input_ids"]
        key = (id(model), id(ids))
        ref = weakref.ref(ids, lambda _, key=key: _ROPE_ROWS.pop(key, None))
        _ROPE_ROWS[key] = (ref, pos[:, b, pos.shape[2] - ids.shape[1] :].clone(), delta[b].clone())


def _remembered_rows(model: torch.nn.Module, prompts: list[dict[str, Tensor]], length: int):
    """(3, B, length) positions and (B, 1) offsets from remembered rows, left-padded with the zeros that
    `get_rope_index` leaves on padding; None unless every prompt's rows are remembered."""
    rows = []
    for prompt in prompts:
        entry = _ROPE_ROWS.get((id(model), id(prompt["input_ids"])))
        if entry is None or entry[0]() is not prompt["input_ids"]:
            return None
        rows.append(entry)
    first = rows[0][1]
    pos = first.new_zeros((3, len(rows), length))
    for b, (_, row, _) in enumerate(rows):
        pos[:, b, length - row.shape[1] :] = row
    return pos, torch.stack([delta for _, _, delta in rows])


@dataclass
class Prefix:
    """Prompts after one forward pass, expanded to R rows (one per continuation); see `prefill`."""

    cache: object  # the model's KV cache, R rows
    last_logits: Tensor  # (R, V) logits at each prompt's last token: the distribution of the first response token
    attention_mask: Tensor  # (R, L) left-padded prompt mask
    rope_delta: Tensor | None  # (R, 1) M-RoPE offset of text after the prompt (Qwen-VL), None for 1-D positions
    cross_attention_mask: Tensor | None  # (R, 1, images, tiles) what response tokens attend to (Mllama)
    cache_arg: str  # the name of the forward argument that takes the cache (see `cache_argument`)
    decode_mask: bool = False  # one-token steps pass their attention mask ready-made (see `ready_decode_mask`)
    # the same prefill run again (its R rows as made first, a fresh cache): the static decoding's fallback, which
    # keeps this instead of the cache (R4-1: the cache's keys and values would be a second copy of the prompts')
    again: Callable[[], Prefix] | None = field(default=None, repr=False)

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (e.g. the continuations still decoding), cache included."""
        select_cache_rows(self.cache, rows)
        self.last_logits, self.attention_mask = self.last_logits[rows], self.attention_mask[rows]
        if self.rope_delta is not None:
            self.rope_delta = self.rope_delta[rows]
        if self.cross_attention_mask is not None:
            self.cross_attention_mask = self.cross_attention_mask[rows]


def prefill(model: torch.nn.Module, prompts: list[dict[str, Tensor]], pad_id: int, mrope: bool) -> Prefix:
    """Run each distinct prompt once and repeat its cache, logits and masks to one row per entry of `prompts`.

    prompts: processor outputs, one per row; the same dict object K times means K rows continue one prompt
    (repeated rows need not be adjacent). The prompt pass keeps its autograd graph when gradients are on, so a
    loss on the continuations back-propagates through the shared prompt (and vision) computation.
    Positions are explicit, as `generate` makes them: left padding skipped; for M-RoPE, the model's own
    `get_rope_index`, whose per-row offset also places every later text token.
    """
    index: dict[int, int] = {}
    device = model_device(model)
    rows = torch.tensor([index.setdefault(id(p), len(index)) for p in prompts], device=device)
    unique = list({id(p): p for p in prompts}.values())
    inputs = on_device(collate(unique, pad_id, aligned=aligned_keys(model))[0], device)
    inputs["position_ids"], rope_delta = model_positions(model, inputs, mrope, unique)
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    cache_arg = cache_argument(type(unwrapped(model)))
    cache = getattr(out, cache_arg)
    select_cache_rows(cache, rows)
    cross = inputs.get("cross_attention_mask")
    return Prefix(
        cache,
        out.logits[rows, -1],
        inputs["attention_mask"][rows],
        None if rope_delta is None else rope_delta[rows],
        None if cross is None else cross[rows, -1:],
        cache_arg,
        ready_decode_mask(unwrapped(model).config),
        functools.partial(prefill, model, prompts, pad_id, mrope),
    )


class DecodeSteps:
    """One-token decoding steps after a `Prefix` when every new token is real (the rollout's decoding): the
    inputs `continuation` would build, without rebuilding the attention mask (a concatenation) or counting
    positions over it (a cumulative sum) at every token. The mask is made once for `limit` new tokens and each
    step passes a view of it; a row's position is its prompt's real length plus the tokens before it. The
    cache's growing layers get room for the `limit` tokens (`reserve_cache`)."""

    def __init__(self, prefix: Prefix, limit: int):
        reserve_cache(prefix.cache, limit)
        self.prefix, self.prompt_length = prefix, prefix.attention_mask.shape[1]
        mask = prefix.attention_mask.new_ones((len(prefix.attention_mask), self.prompt_length + limit))
        mask[:, : self.prompt_length] = prefix.attention_mask
        self.mask = mask.bool() if prefix.decode_mask else mask
        start = prefix.attention_mask.long().sum(dim=1, keepdim=True)  # (R, 1): the first new token's position
        self.start = start if prefix.rope_delta is None else start + prefix.rope_delta

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (the continuations still decoding), the prefix's cache included."""
        self.prefix.select(rows)
        self.mask, self.start = self.mask[rows], self.start[rows]

    def inputs(self, token_ids: Tensor, t: int) -> dict[str, Tensor]:
        """Model inputs feeding (R, 1) `token_ids`, the t-th new token of each row (0-based): the cache holds the
        prompt and the t before it. Equal to `continuation(prefix, token_ids, ones(R, t + 1))`."""
        prefix, keys = self.prefix, self.prompt_length + t + 1
        pos = self.start + t  # (R, 1)
        inputs = {
            "input_ids": token_ids,
            "attention_mask": self.mask[:, None, None, :keys] if prefix.decode_mask else self.mask[:, :keys],
            "position_ids": pos if prefix.rope_delta is None else pos.unsqueeze(0).expand(3, -1, -1),
            prefix.cache_arg: prefix.cache,
            "use_cache": True,
        }
        if prefix.cross_attention_mask is not None:
            inputs["cross_attention_mask"] = prefix.cross_attention_mask
        return inputs


def ready_decode_mask(config) -> bool:
    """Whether a one-token decoding step may pass its attention mask ready-made, as (R, 1, 1, keys) booleans.

    For one new token the causal mask is just the padding mask: every key is an earlier token. transformers
    takes a 4-D mask as it is and skips building its own, which was a fifth of a decoding step's time on a
    tiny model (sdpa's mask: booleans, True = attend). Only where that one mask serves every layer: sdpa
    attention, and full attention in every layer (a sliding window or a linear-attention layer needs its own).
    """
    text = config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    return text._attn_implementation == "sdpa" and layer_types == {"full_attention"} and not sliding


def continuation(prefix: Prefix, token_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
    """Model inputs that feed (R, T) new tokens after `prefix` and whatever its cache already holds past the prompt.

    attention_mask: (R, D + T), 0 on right padding, over every token after the prompt: the D already in the
    cache (decoding) and the T new ones. Matches a forward pass over prompt + tokens, and `generate`'s decoding
    steps: the full attention mask, positions counted from each prompt's real length, M-RoPE offsets, the
    cross-attention mask of the prompt's last token. Token-type ids are left out: new tokens are text, their
    default.
    """
    mask = torch.cat([prefix.attention_mask, attention_mask.to(prefix.attention_mask.dtype)], dim=1)
    pos = position_ids(mask)[:, -token_ids.shape[1] :]  # (R, T)
    if prefix.rope_delta is not None:
        pos = (pos + prefix.rope_delta).unsqueeze(0).expand(3, -1, -1)  # (3, R, T): t, h, w all advance as text
    inputs = {
        "input_ids": token_ids,
        "attention_mask": mask.bool()[:, None, None, :] if prefix.decode_mask and token_ids.shape[1] == 1 else mask,
        "position_ids": pos,
        prefix.cache_arg: prefix.cache,
        "use_cache": True,
    }
    if prefix.cross_attention_mask is not None:
        cross = prefix.cross_attention_mask
        inputs["cross_attention_mask"] = cross.expand(-1, token_ids.shape[1], *cross.shape[2:])
    return inputs

"""A model's KV cache as the rollout and the update use it: the name its forward takes it under, keeping some of
its rows (a GRPO group's K continuations of one prompt, the rows still decoding), and room reserved for a
response so decoding writes each token in place."""

from __future__ import annotations

import functools
import inspect

from torch import Tensor
from transformers.cache_utils import DynamicLayer


@functools.cache
def cache_argument(model_class: type) -> str:
    """The KV cache's name, as forward argument and output field: transformers renamed `past_key_values` to
    `cache` after 5.19 (the old name warns, and goes in 5.40); the project admits both sides of the rename."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def select_cache_rows(cache, rows: Tensor) -> None:
    """Keep `rows` (repeats allowed) of every layer of a KV cache. A linear-attention layer (Qwen3.5's gated
    delta rule: conv and recurrent states, no batch_select_indices of its own, or one that keeps only the keys
    and values of its attention half) index-selects all its states through its beam-search `reorder_cache`."""
    for layer in getattr(cache, "layers", None) or [cache]:
        if hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states"):
            layer.reorder_cache(rows)
        else:
            layer.batch_select_indices(rows)


def reserve_cache(cache, room: int) -> None:
    """Give each plain growing layer of a KV cache (transformers' DynamicLayer: full attention) room for `room`
    more positions, as a `ReservedLayer`. Sliding-window and linear-attention layers keep their own classes."""
    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[i] = ReservedLayer(layer, room)


class ReservedLayer(DynamicLayer):
    """A DynamicLayer that, at its first update, moves its keys and values into buffers with room for `room`
    more positions, then writes each update in place: its keys and values are views of the filled part.
    transformers' own layer concatenates, copying the whole cache of every layer at every decoded token (a 7B
    Qwen2.5-VL decoding 64 rows after 1,500 prompt tokens: ~11 GB per token, two thirds of its weights' bytes).
    A layer never updated (Mllama's cross-attention states) allocates nothing; one that runs out of room gets
    `room` more. The buffers are the cache's full length from the first decoded token on, as the memory plan
    counts it (`rollout_kv_cache`)."""

    def __init__(self, layer: DynamicLayer, room: int):
        super().__init__()
        vars(self).update(vars(layer))  # its keys, values and state, as they are
        self.room, self.buffers, self.filled = room, None, 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized or self.get_seq_length() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        new = key_states.shape[-2]
        if self.buffers is None or self.filled + new > self.buffers[0].shape[-2]:  # none yet, or out of room
            self.buffers = tuple(_with_room(t, max(self.room, new)) for t in (self.keys, self.values))
            self.filled = self.keys.shape[-2]
        keys, values = self.buffers
        keys[..., self.filled : self.filled + new, :] = key_states
        values[..., self.filled : self.filled + new, :] = value_states
        self.filled += new
        self.keys, self.values = keys[..., : self.filled, :], values[..., : self.filled, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.buffers is None:
            return super().batch_select_indices(indices)
        self.buffers = tuple(b[indices, ...] for b in self.buffers)
        self.keys, self.values = (b[..., : self.filled, :] for b in self.buffers)


def _with_room(t: Tensor, room: int) -> Tensor:
    """`t` (batch, heads, positions, dim) copied into a buffer with `room` more positions."""
    out = t.new_empty((*t.shape[:-2], t.shape[-2] + room, t.shape[-1]))
    out[..., : t.shape[-2], :] = t
    return out

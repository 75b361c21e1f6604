"""The HF engine's one-token decoding steps over a static KV cache (`HFEngine`'s `static_cache`), replayed as CUDA
graphs on a GPU.

Today's loop (`batching.DecodeSteps`) hands transformers a growing cache and a batch that shrinks as rows end:
every step has new shapes, so each is a fresh round of Python and kernel launches (on an H200, 48 ms per step
of 64 rows of a 2B model, launch-bound). Here the prompt's prefill stays eager (`batching.prefill`); its keys
and values are then copied into transformers' `StaticCache`, sized to a bucket of rows and positions
(`bucket_rows`, `bucket_length`), and every one-token step has the same shapes: (B, 1) token ids, a (B, 1, 1, S)
ready-made attention mask over the whole cache (positions not yet written are masked) and explicit positions.
Rows that end stay in the batch, fed the pad token, their tokens cut off by their length as the loop already
does between two sync points; the bucket's spare rows repeat row 0 and are never read. On CUDA the step is
`torch.compile(mode="reduce-overhead")`, which captures it as a CUDA graph per bucket and replays it; on a CPU
it runs eagerly (the same tokens and log-probs as today's loop: tests/test_static_decode.py).

A model whose cache this does not fit (cross-attention states: Mllama; sliding-window or linear-attention
layers; an attention implementation that needs transformers' own mask) keeps today's loop, and so does one
whose first static step raises; either is logged once per reason (`fallback_reasons` keeps them).
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict

import torch
from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import DynamicLayer

from vlm_corl.members.batching import DecodeSteps, Prefix, unwrapped

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
LENGTH_BUCKET = 256  # cache positions are rounded up to a multiple of this: one graph serves many prompt lengths

fallback_reasons: list[str] = []  # every distinct reason the static path was refused, in order, each logged once


def use_static_cache(mode: str, device: torch.device) -> bool:
    """Whether the HF engine's `static_cache` = `mode` decodes over a static cache on `device`: auto = on CUDA only
    (on a CPU a step's launches cost little, and every new bucket would be allocated for nothing)."""
    if mode not in MODES:
        raise ValueError(f"the HF engine's static_cache must be one of {', '.join(MODES)}, not {mode!r}")
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


def bucket_rows(rows: int) -> int:
    """The static batch for `rows` decoding rows: the next power of two, so calls with a few prompts more or
    fewer replay one captured graph instead of capturing another."""
    return 1 << max(rows - 1, 0).bit_length()


def bucket_length(positions: int) -> int:
    """The static cache's length for `positions` (prompt + new tokens): the next multiple of LENGTH_BUCKET."""
    return -(-positions // LENGTH_BUCKET) * LENGTH_BUCKET


def compile_step(step, device: torch.device):
    """`step` as the decoding loop calls it: on CUDA compiled with mode reduce-overhead (captured as a CUDA graph
    at its first calls per shape, then replayed; shapes are fixed, so dynamic=False), elsewhere as it is."""
    if torch.device(device).type != "cuda":
        return step
    # every bucket of every member's engine is one more compiled entry of the same code: dynamo's default of 8
    # per code object would leave a cohort's later buckets silently eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(step, mode="reduce-overhead", dynamic=False)


def unsupported(model: torch.nn.Module, prefix: Prefix) -> str | None:
    """Why a static cache cannot hold this model's decoding state (None when it can)."""
    config = unwrapped(model).config
    if prefix.cross_attention_mask is not None:
        return f"{config.model_type}: cross-attention states (a static cache holds self-attention only)"
    if not prefix.decode_mask:  # batching.ready_decode_mask: sdpa over full attention in every layer
        text = config.get_text_config()
        kinds = sorted(set(getattr(text, "layer_types", None) or ["full_attention"]))
        return (
            f"{config.model_type}: attention {text._attn_implementation} over layers {', '.join(kinds)} (sliding "
            f"window {getattr(text, 'sliding_window', None)}): the static path needs sdpa over full attention"
        )
    layers = getattr(prefix.cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or [prefix.cache]})
        return f"{config.model_type}: cache layers {', '.join(kinds)} (a static cache copies full-attention ones)"
    # transformers decides the static layers from the config on its own: they must be plain full attention too
    static = {type(layer).__name__ for layer in StaticCache(config=config, max_cache_len=1).layers}  # unallocated
    if static != {"StaticLayer"}:
        return f"{config.model_type}: static cache layers {', '.join(sorted(static))}"
    return None


def decode_steps(
    model: torch.nn.Module, prefix: Prefix, limit: int, mode: str, pad_id: int, buckets: StaticBuckets | None = None
):
    """The decoding steps after `prefix` for up to `limit` new tokens: `StaticSteps` when `mode` asks for the
    static cache on this device and the model fits it, else today's `EagerSteps` (the reason logged once); ended
    rows are fed `pad_id`; `buckets`: the engine's static caches (a fresh set when None)."""
    if not use_static_cache(mode, prefix.last_logits.device):
        return EagerSteps(model, prefix, limit)
    reason = unsupported(model, prefix)
    if reason is not None:
        _fall_back(reason)
        return EagerSteps(model, prefix, limit)
    return StaticSteps(model, prefix, limit, pad_id, StaticBuckets() if buckets is None else buckets)


def _fall_back(reason: str) -> None:
    """Log once per distinct reason that the rollout keeps today's loop."""
    if reason not in fallback_reasons:
        fallback_reasons.append(reason)
        log.warning("HF engine static_cache: decoding without a static cache: %s", reason)


class EagerSteps:
    """Today's loop (`batching.DecodeSteps`): a growing cache, and rows that end leave the batch at a sync."""

    keeps_rows = False  # the loop removes ended rows (`select`)
    static = False

    def __init__(self, model: torch.nn.Module, prefix: Prefix, limit: int):
        self.model, self.steps = model, DecodeSteps(prefix, limit)

    def logits(self, token_ids: Tensor, alive: Tensor, t: int) -> Tensor:
        """(A, V) next-token logits after feeding (A,) `token_ids`, the t-th new token of each batch row."""
        return self.model(**self.steps.inputs(token_ids[:, None], t)).logits[:, -1]

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` of the batch."""
        self.steps.select(rows)


class StaticBuckets:
    """The static caches of one engine's model, one per bucket (rows, positions, dtype), each with its mask and
    its compiled step, kept across rollouts: a later rollout of the same bucket copies its prompts into the same
    tensors and replays the same graph (a new cache would be new static addresses: a recompile and a new
    capture); they stay allocated through the member's update (a bucket of 64 rows x 512 positions of a
    Qwen2-VL-2B: ~0.9 GB of bf16 keys and values). At most MAX_BUCKETS, the least recently used dropped."""

    MAX_BUCKETS = 4

    def __init__(self):
        self.buckets: OrderedDict[tuple, _Bucket] = OrderedDict()

    def get(self, model: torch.nn.Module, cache_arg: str, key: tuple) -> _Bucket:
        """The bucket of `key` (rows, positions, dtype, device) for `model`, made at its first use."""
        if key not in self.buckets:
            self.buckets[key] = _Bucket(model, cache_arg, *key)
            while len(self.buckets) > self.MAX_BUCKETS:
                self.buckets.popitem(last=False)
        self.buckets.move_to_end(key)
        return self.buckets[key]


class _Bucket:
    """A StaticCache of `batch` rows and `length` positions, its (batch, 1, 1, length) attention mask and the
    model's one-token step over them (compiled on CUDA)."""

    def __init__(self, model, cache_arg: str, batch: int, length: int, dtype: torch.dtype, device: torch.device):
        config = unwrapped(model).config
        self.cache = StaticCache(config=config, max_cache_len=length)  # StaticLayers only (`unsupported`)
        self.mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=device)
        cache = self.cache

        def forward(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *extra: Tensor) -> Tensor:
            kwargs = {"cache_position": extra[0]} if extra else {}
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **{cache_arg: cache}, **kwargs,
            )  # fmt: skip
            return out.logits[:, -1]

        self.forward = forward
        self.step = compile_step(forward, device)

    def load(self, source, rows: Tensor) -> int:
        """Hold `source`'s keys and values of `rows` (repeats allowed) in the first positions of every layer
        (what a previous rollout left past them stays masked until overwritten); returns how many positions."""
        for layer, src in zip(self.cache.layers, source.layers, strict=True):
            keys, values = src.keys[rows], src.values[rows]
            held = keys.shape[-2]
            if not layer.is_initialized:
                # the write that allocates the layer: at its counted positions (transformers 5.25: from 0), or at
                # `cache_position` (older 5.x)
                layer.update(keys, values, {"cache_position": torch.arange(held, device=keys.device)})
                continue
            layer.keys[..., :held, :], layer.values[..., :held, :] = keys, values
            if hasattr(layer, "cumulative_length"):  # the positions it counts; older 5.x take `cache_position`
                layer.cumulative_length.fill_(held)
        return held


class StaticSteps:
    """One-token steps of fixed shapes over a static cache of `bucket_rows(R)` rows and `bucket_length(L +
    limit)` positions (a bucket of `buckets`) holding the prefix's keys and values; a row that ends stays, fed
    the pad token."""

    def __init__(self, model: torch.nn.Module, prefix: Prefix, limit: int, pad_id: int, buckets: StaticBuckets):
        self.model, self.prefix, self.limit = model, prefix, limit
        rows, self.prompt_length = prefix.attention_mask.shape
        self.rows, self.batch = rows, bucket_rows(rows)
        self.length = bucket_length(self.prompt_length + limit)
        device = prefix.last_logits.device
        # spare rows repeat row 0: real keys and a real mask, so their (unread) logits stay finite
        fill = torch.cat([torch.arange(rows), torch.zeros(self.batch - rows, dtype=torch.long)]).to(device)
        dtype = prefix.cache.layers[0].keys.dtype
        self.bucket = buckets.get(model, prefix.cache_arg, (self.batch, self.length, dtype, device))
        self.bucket.load(prefix.cache, fill)
        self.mask = self.bucket.mask
        self.mask.zero_()
        self.mask[:, 0, 0, : self.prompt_length] = prefix.attention_mask[fill].bool()
        start = prefix.attention_mask.long().sum(dim=1, keepdim=True)[fill]  # (B, 1) the first new token's place
        self.start = start if prefix.rope_delta is None else start + prefix.rope_delta[fill]
        self.fill, self.pad = fill, torch.tensor(pad_id, device=device)
        # the cache's position argument where the installed transformers still takes one (older 5.x), else its
        # layers count the positions they hold
        self.cache_position = "cache_position" in inspect.signature(type(unwrapped(model)).forward).parameters
        self.cuda = device.type == "cuda"
        self.fallback: EagerSteps | None = None
        self.calls = 0

    def logits(self, token_ids: Tensor, alive: Tensor, t: int) -> Tensor:
        """(R, V) next-token logits after feeding (R,) `token_ids` (the pad token where a row has ended), the t-th
        new token of each row. The first step falls back to today's loop if it raises."""
        if self.fallback is not None:
            return self.fallback.logits(token_ids, alive, t)
        fed = torch.where(alive, token_ids, self.pad)[self.fill][:, None]  # (B, 1)
        position = self.prompt_length + t
        self.mask[:, 0, 0, position] = True
        pos = self.start + t  # (B, 1)
        args = [fed, self.mask, pos if self.prefix.rope_delta is None else pos.unsqueeze(0).expand(3, -1, -1)]
        if self.cache_position:
            args.append(torch.tensor([position], device=fed.device))
        if self.cuda:  # the graph's previous outputs are dead: its next replay may write over them
            torch.compiler.cudagraph_mark_step_begin()
        try:
            logits = self.bucket.step(*args)
        except Exception as err:  # noqa: BLE001 - any failure of the first step is a reason to keep today's loop
            if self.calls:
                raise
            _fall_back(f"{unwrapped(self.model).config.model_type}: the first static step raised {err!r}")
            self.fallback = EagerSteps(self.model, self.prefix, self.limit)
            return self.fallback.logits(token_ids, alive, t)
        self.calls += 1
        return logits[: self.rows].clone()  # a copy: the next replay writes over the graph's output

    def select(self, rows: Tensor) -> None:
        """Never called while static (`keeps_rows`); after a fallback, today's loop removes rows."""
        self.fallback.select(rows)

    @property
    def static(self) -> bool:
        """Whether the steps run over the static cache (False once the first step fell back)."""
        return self.fallback is None

    @property
    def keeps_rows(self) -> bool:
        """Whether the batch keeps its ended rows (static: its shapes stay the graph's) or the loop removes them."""
        return self.fallback is None

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
`torch.compile(mode="reduce-overhead")`, which captures it as a CUDA graph and replays it; on a CPU it runs
eagerly (the same tokens and log-probs as today's loop: tests/test_static_decode.py).

Memory: once the prompt's keys and values are in the bucket nothing holds the prefix's cache (a second copy of
the prompt's KV during the whole decoding); a first step that raises prefills the prompts again for today's loop
(`Prefix.again`). An engine holds one bucket at a time (`StaticBuckets`: another shape frees the old one before
allocating), and none through the update (`HFEngine.sleep` clears it), which is what the memory plan counts.
Compiling: every bucket shares one compiled code object; dynamo keeps one entry per shape (rows bucket, length
bucket, architecture, dtypes), which a new bucket of a known shape reuses (only the CUDA graph is recorded
again). Each new shape is a full compile, so a process compiles at most MAX_SHAPES of them (`shapes` counts
them); a rollout of a further shape decodes with today's loop.

The static path is refused before any bucket is allocated, logged once per reason (`fallback_reasons`), for a
model whose cache it does not fit (cross-attention states: Mllama; sliding-window or linear-attention layers; an
attention implementation that needs transformers' own mask), a static cache whose values could not take what a
step writes (transformers 5.19 allocates them in the keys' dtype: fp32 keys and bf16 values under autocast), a
shape past MAX_SHAPES, or a shape whose first step raised before; a static step that raises after the first
raises (tokens were decoded from the static cache: no loop could take over from there).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from vlm_corl.members.batching import DecodeSteps, Prefix, unwrapped

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
LENGTH_BUCKET = 256  # cache positions are rounded up to a multiple of this: one graph serves many prompt lengths
# Distinct static step shapes a process compiles (each a full dynamo + inductor compile of the decoder step): far
# fewer than dynamo's recompile_limit (64, `compile_step`), past which it would run new shapes eagerly and
# silently, over the whole bucket (slower than today's loop); a further shape decodes with today's loop, logged.
MAX_SHAPES = 32

fallback_reasons: list[str] = []  # every distinct reason the static path was refused, in order, each logged once
shapes: dict[Shape, int] = {}  # every static step shape this process compiled (on CUDA): its rollouts
refused: dict[Shape, str] = {}  # shapes whose first static step raised: later rollouts refuse them at once


class Shape(NamedTuple):
    """What one compiled static step is specialised to (and an engine's bucket is keyed by)."""

    batch: int  # bucket_rows of the rollout's rows
    length: int  # bucket_length of prompt + new tokens
    architecture: str  # the model's class: every one shares the step's code object, each is its own compile
    keys: torch.dtype  # the cache's keys and values
    values: torch.dtype
    autocast: torch.dtype | None  # the autocast dtype the step runs under (None: off)
    device: torch.device


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


def compiles(device: torch.device) -> bool:
    """Whether the static step is compiled on `device` (CUDA; elsewhere it runs as it is)."""
    return torch.device(device).type == "cuda"


def compile_step(step, device: torch.device):
    """`step` as the decoding loop calls it: on CUDA compiled with mode reduce-overhead (captured as a CUDA graph
    at its first calls per shape, then replayed; shapes are fixed, so dynamic=False), elsewhere as it is."""
    if not compiles(device):
        return step
    # every shape of every member's engine is one more compiled entry of the same code: dynamo's default of 8
    # per code object would leave later shapes silently eager (MAX_SHAPES keeps the count below this)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(step, mode="reduce-overhead", dynamic=False)


def step_shape(model: torch.nn.Module, prefix: Prefix, limit: int) -> Shape:
    """The static step shape (and bucket) that decoding `limit` tokens after `prefix` would use."""
    layer = prefix.cache.layers[0]
    device = layer.keys.device
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    rows, length = prefix.attention_mask.shape
    name = type(unwrapped(model)).__name__
    return Shape(bucket_rows(rows), bucket_length(length + limit), name, layer.keys.dtype, layer.values.dtype,
                 autocast, device)  # fmt: skip


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
    static = static_layer_kinds(config)
    if static != {"StaticLayer"}:
        return f"{config.model_type}: static cache layers {', '.join(sorted(static))}"
    return None


def static_layer_kinds(config) -> set[str]:
    """The layer classes of the StaticCache transformers builds for `config` (decided from the config on its own,
    unallocated): the static path needs plain full-attention `StaticLayer`s only (the planner asks too)."""
    return {type(layer).__name__ for layer in StaticCache(config=config, max_cache_len=1).layers}


def unwritable(model_type: str, shape: Shape) -> str | None:
    """Why a static cache of `shape` could not take the values a decoding step writes (None when it can): a step
    writes them in the autocast dtype when autocast is on (a Linear's output), else in the prefix's own dtype,
    and the static layer copies them in place (`index_copy_`: equal dtypes or a RuntimeError)."""
    held = shape.keys if values_in_keys_dtype() else shape.values
    written = shape.values if shape.autocast is None else shape.autocast
    if held == written:
        return None
    return (
        f"{model_type}: the prompt's cache holds keys {shape.keys} and values {shape.values}; a static cache would "
        f"hold the values in {held}{' (this transformers allocates them in the keys dtype)' * (held != shape.values)}"
        f" but a decoding step writes them in {written}"
    )


@functools.cache
def values_in_keys_dtype() -> bool:
    """Whether the installed transformers allocates a static layer's values in its keys' dtype (5.19 does; 5.25
    gives each its own), found by allocating a one-position layer."""
    layer = StaticLayer(max_cache_len=1)
    layer.lazy_initialization(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16))
    return layer.values.dtype == torch.float32


def _new_shape(shape: Shape) -> str | None:
    """Count a rollout of `shape` where the step is compiled (`shapes`); why it is refused when it would be a
    compile past MAX_SHAPES (None when it is not)."""
    if not compiles(shape.device):
        return None
    if shape not in shapes:
        if len(shapes) >= MAX_SHAPES:
            return (
                f"{MAX_SHAPES} static step shapes compiled already (MAX_SHAPES): rollouts of a new shape (rows, "
                "positions, architecture, dtypes) decode with today's loop"
            )
        log.info("HF engine static_cache: static step shape %d of at most %d: %s", len(shapes) + 1, MAX_SHAPES, shape)
    shapes[shape] = shapes.get(shape, 0) + 1
    return None


def decode_steps(
    model: torch.nn.Module, prefix: Prefix, limit: int, mode: str, pad_id: int, buckets: StaticBuckets | None = None
):
    """The decoding steps after `prefix` for up to `limit` new tokens: `StaticSteps` when `mode` asks for the
    static cache on this device and it can work here, else today's `EagerSteps` (the reason logged once, decided
    before any bucket is allocated); ended rows are fed `pad_id`; `buckets`: the engine's static cache (a fresh
    one when None)."""
    if not use_static_cache(mode, prefix.last_logits.device):
        return EagerSteps(model, prefix, limit)
    reason = unsupported(model, prefix)
    if reason is None:
        shape = step_shape(model, prefix, limit)
        reason = unwritable(unwrapped(model).config.model_type, shape) or refused.get(shape) or _new_shape(shape)
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
    """An engine's static cache: one bucket (a `Shape`'s cache, its mask and its compiled step) at a time, kept
    from one rollout to the next while the engine is awake, so a later rollout of the same shape copies its
    prompts into the same tensors and replays the same graph. Another shape's bucket replaces it, the old one
    freed before the new one is allocated; `HFEngine.sleep` frees it (`clear`) for the update. The memory plan
    counts exactly that: one bucket while decoding, none after (a bucket of 128 rows x 2048 positions of a
    Qwen2-VL-2B: 7.5 GB of bf16 keys and values)."""

    def __init__(self):
        self.shape: Shape | None = None
        self.bucket: _Bucket | None = None

    def get(self, model: torch.nn.Module, cache_arg: str, shape: Shape) -> _Bucket:
        """The bucket of `shape` for `model`, made at its first use."""
        if shape != self.shape:
            self.clear()  # first: the old bucket's memory goes before the new one is taken
            self.bucket, self.shape = _Bucket(model, cache_arg, shape), shape
        return self.bucket

    def clear(self) -> None:
        """Drop the bucket (its compiled code stays with dynamo: a later bucket of its shape reuses it)."""
        self.shape = self.bucket = None


class _Bucket:
    """A StaticCache of `shape.batch` rows and `shape.length` positions, its (batch, 1, 1, length) attention mask
    and the model's one-token step over them (compiled on CUDA)."""

    def __init__(self, model, cache_arg: str, shape: Shape):
        config = unwrapped(model).config
        self.cache = StaticCache(config=config, max_cache_len=shape.length)  # StaticLayers only (`unsupported`)
        self.mask = torch.zeros(shape.batch, 1, 1, shape.length, dtype=torch.bool, device=shape.device)
        cache = self.cache

        def forward(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *extra: Tensor) -> Tensor:
            kwargs = {"cache_position": extra[0]} if extra else {}
            out = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **{cache_arg: cache}, **kwargs,
            )  # fmt: skip
            return out.logits[:, -1]

        self.forward = forward
        self.step = compile_step(forward, shape.device)

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
    limit)` positions (the bucket of `buckets`) holding the prefix's keys and values, and nothing of the prefix's
    own cache; a row that ends stays, fed the pad token."""

    def __init__(self, model: torch.nn.Module, prefix: Prefix, limit: int, pad_id: int, buckets: StaticBuckets):
        self.model, self.limit, self.again, self.buckets = model, limit, prefix.again, buckets
        self.shape = step_shape(model, prefix, limit)
        rows, self.prompt_length = prefix.attention_mask.shape
        self.rows, self.batch, device = rows, self.shape.batch, self.shape.device
        # spare rows repeat row 0: real keys and a real mask, so their (unread) logits stay finite
        fill = torch.cat([torch.arange(rows), torch.zeros(self.batch - rows, dtype=torch.long)]).to(device)
        self.bucket = buckets.get(model, prefix.cache_arg, self.shape)
        self.bucket.load(prefix.cache, fill)
        self.mask = self.bucket.mask
        self.mask.zero_()
        self.mask[:, 0, 0, : self.prompt_length] = prefix.attention_mask[fill].bool()
        start = prefix.attention_mask.long().sum(dim=1, keepdim=True)[fill]  # (B, 1) the first new token's place
        self.mrope = prefix.rope_delta is not None
        self.start = start + prefix.rope_delta[fill] if self.mrope else start
        self.pad = torch.tensor(pad_id, device=device)
        self.fill = fill
        # the cache's position argument where the installed transformers still takes one (older 5.x), else its
        # layers count the positions they hold
        self.cache_position = "cache_position" in inspect.signature(type(unwrapped(model)).forward).parameters
        self.cuda = device.type == "cuda"
        self.fallback: EagerSteps | None = None
        self.calls = 0

    def logits(self, token_ids: Tensor, alive: Tensor, t: int) -> Tensor:
        """(R, V) next-token logits after feeding (R,) `token_ids` (the pad token where a row has ended), the t-th
        new token of each row. The first step falls back to today's loop if it raises; a later one raises."""
        if self.fallback is not None:
            return self.fallback.logits(token_ids, alive, t)
        fed = torch.where(alive, token_ids, self.pad)[self.fill][:, None]  # (B, 1)
        position = self.prompt_length + t
        self.mask[:, 0, 0, position] = True
        pos = self.start + t  # (B, 1)
        args = [fed, self.mask, pos.unsqueeze(0).expand(3, -1, -1) if self.mrope else pos]
        if self.cache_position:
            args.append(torch.tensor([position], device=fed.device))
        if self.cuda:  # the graph's previous outputs are dead: its next replay may write over them
            torch.compiler.cudagraph_mark_step_begin()
        try:
            logits = self.bucket.step(*args)
        except Exception as err:  # noqa: BLE001 - any failure of the first step is a reason to keep today's loop
            if self.calls:  # tokens came from the static cache already: no other loop holds their keys
                raise
            return self._fall_back(err).logits(token_ids, alive, t)
        self.calls += 1
        return logits[: self.rows].clone()  # a copy: the next replay writes over the graph's output

    def _fall_back(self, err: Exception) -> EagerSteps:
        """Today's loop after a first static step that raised `err`: the bucket freed, the prompts prefilled again
        (their first cache was not kept), and the shape refused from now on (logged once)."""
        reason = f"{unwrapped(self.model).config.model_type}: the first static step raised {err!r}"
        refused[self.shape] = reason
        _fall_back(reason)
        self.buckets.clear()
        self.bucket = None
        self.fallback = EagerSteps(self.model, self.again(), self.limit)
        return self.fallback

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

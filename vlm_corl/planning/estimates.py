"""Pure estimates of the memory a member's phases allocate beyond its states (`vlm_corl.members.memory`):
activations of an update's micro-batch, its logits, the HF rollout's KV cache, a vLLM engine's share, and
DeepSpeed's buffers. Bytes, from a model's `ModelShape` and the run's settings; every formula is an upper
bound of what the code allocates, worked from what it keeps for the backward pass.

Activations per token and decoder layer (what autograd saves in a Llama/Qwen-style layer with SDPA or flash
attention, which keep no T x T scores): the normed inputs of the attention and MLP blocks, q, k and v, the
attention output, the MLP's gate, up, activated gate and product, in the compute dtype (c bytes: 2 under bf16
autocast, 4 in fp32), plus the two fp32 residual-stream inputs of the norms:

    c * (4 h + 2 kv_dim + 4 I) + 8 h

A vision tower's layers take the same form over its patches (kv_dim = its width). Gradient checkpointing keeps
each layer's fp32 input (4 h per token) and recomputes one layer at a time during the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlm_corl.members.static_decode import bucket_length, bucket_rows
from vlm_corl.planning.shapes import ModelShape

LOGITS_FACTOR = 1.5  # the update's log-prob pass peaks at 1.5 x one copy of its logits (bench/memory.py's target)
CHUNK_BYTES = 3 * (1 << 23) * 4  # grpo.selective_logprobs: a few fp32 row chunks of CHUNK_ELEMENTS
DS_DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed 0.19's default reduce_bucket_size (elements)
DS_DEFAULT_PREFETCH = 50_000_000  # stage3_prefetch_bucket_size
DS_DEFAULT_SUB_GROUP = 1_000_000_000  # ZeRO-3's sub_group_size: its optimizer steps one sub-group at a time

# What vLLM's sleep mode does not free: it releases only the allocations its CuMemAllocator tagged (weights, KV
# cache); the CUDA-graph pool, the compile and attention-backend workspaces and the runner's persistent input and
# sampler buffers stay. vLLM logs the graph pool after capture (1.5 GB per rank in vllm-project/vllm#47654;
# "Level-1 cuMem sleep releases weights and KV cache, but leaves ... CUDA graph pools resident",
# vllm-project/vllm#56373) and its profile counts 0.15-1.3 GiB of non-torch memory (#17117, #11743): 1-3 GB per
# engine, 2 GB here; under enforce_eager there are no graphs, the rest stays.
VLLM_SLEEP_KEEPS_BYTES = 2e9
VLLM_SLEEP_KEEPS_EAGER_BYTES = 0.5e9
# vLLM 0.32's defaults for `vllm.LLM` (engine/arg_utils.py get_batch_defaults): max_num_batched_tokens and
# max_num_seqs are 16384 and 1024 on cards of 70 GiB and more (H100, H200), 8192 and 256 below. Its profile run
# pushes that many tokens through the model and a dummy sampler over that many rows; the peak is taken out of
# the engine's share before the KV cache (TRL lowers max_num_batched_tokens to 4096 for this reason).
VLLM_LARGE_CARD_BYTES = 70 * 2**30
VLLM_BATCH_DEFAULTS = {True: (16384, 1024), False: (8192, 256)}  # large card -> (batched tokens, sequences)
# The dummy sampler's bytes per logit: the fp32 logits, the sorted copy top-k/top-p makes and its int64 indices.
VLLM_SAMPLER_BYTES_PER_LOGIT = 16


def layer_bytes_per_token(hidden: int, intermediate: int, kv_dim: int, compute_bytes: int) -> int:
    """Activation bytes one transformer layer keeps per token for its backward (see the module docstring)."""
    return compute_bytes * (4 * hidden + 2 * kv_dim + 4 * intermediate) + 8 * hidden


def activation_bytes(
    shape: ModelShape, tokens: int, patches: int, compute_bytes: int, checkpointing: bool
) -> dict[str, float]:
    """Activations one micro-batch keeps through its backward: `tokens` positions through the language model
    and `patches` positions through the vision tower (0 for a text model), by tower."""
    out = {}
    towers = [("text", tokens, shape.hidden, shape.layers, shape.intermediate, shape.kv_heads * shape.head_dim)]
    if shape.is_vision and patches:
        v = shape.vision_hidden
        towers.append(("vision", patches, v, shape.vision_layers, shape.vision_intermediate, v))
    for name, positions, h, layers, inter, kv_dim in towers:
        per_layer = layer_bytes_per_token(h, inter, kv_dim, compute_bytes) * positions
        out[name] = (layers * 4 * h * positions + per_layer) if checkpointing else layers * per_layer
    return out


def logits_bytes(rows: int, positions: int, vocab: int, compute_bytes: int) -> float:
    """The update's logits for `rows` responses of `positions` tokens (only response positions are kept:
    `logits_to_keep`), their gradient written in place, and the upcast row chunks."""
    return LOGITS_FACTOR * rows * positions * vocab * compute_bytes + CHUNK_BYTES


def kv_bytes_per_token(shape: ModelShape, key_bytes: int, value_bytes: int | None = None) -> int:
    """Key and value cache of one token over every layer: keys of `key_bytes` per element, values of
    `value_bytes` (the same unless given: `hf_kv_dtypes`)."""
    values = key_bytes if value_bytes is None else value_bytes
    return shape.layers * shape.kv_heads * shape.head_dim * (key_bytes + values)


def hf_kv_dtypes(rollout_bytes: int, weights_bytes: int) -> tuple[int, int]:
    """(key, value) bytes per element of the HF rollout's KV cache, computed in the `rollout_bytes` dtype from
    weights of `weights_bytes`. Weights in the rollout dtype (a trained member's or an EMA teacher's bf16 rollout
    copy, a ZeRO-3 member's, a LoRA member's bf16 base, a frozen peer cast at load) give both in it. Under
    autocast over fp32 weights (left only for a LoRA member's fp32 base) the residual stream stays fp32, so the
    rotary embedding's cos and sin are fp32 and `k * cos` promotes the keys to fp32; the values come out of
    v_proj in bf16, but transformers 5.19 (the GPU stack's) allocates a cache layer's values in its keys' dtype,
    so both are counted at the weights' bytes (5.25 keeps bf16 values: an upper bound there;
    tests/test_planner_counts.py checks a tiny Qwen2 under CPU autocast)."""
    return max(rollout_bytes, weights_bytes), max(rollout_bytes, weights_bytes)


@dataclass(frozen=True)
class RolloutBatch:
    """The size of one rank's rollout: `prompts` prompts x `n` samples, each row up to `prompt_tokens` +
    `new_tokens` long (rollout.max_prompt_tokens, rollout.max_new_tokens)."""

    prompts: int
    n: int
    prompt_tokens: int
    new_tokens: int


def hf_rollout_bytes(
    shape: ModelShape, batch: RolloutBatch, patches: int, dtype_bytes: int, weights_bytes: int, static: bool = False
) -> dict[str, float]:
    """The HF engine's rollout of `batch` in the `dtype_bytes` dtype from weights of `weights_bytes`: the KV
    cache of every row at its longest (its keys and values as `hf_kv_dtypes` says), and the prefill's transient
    (one layer's activations over the prompts, without gradients; the vision tower's over their images,
    `patches` each), in the rollout dtype. With `static` (the static decoder on CUDA) the decode's KV is its
    bucket instead, with its CUDA-graph pool and the prefix's KV while it is copied in (`static_decode_bytes`)."""
    prompts, prompt_tokens = batch.prompts, batch.prompt_tokens
    rows = prompts * batch.n
    kv_dtypes = hf_kv_dtypes(dtype_bytes, weights_bytes)
    per_token = kv_bytes_per_token(shape, *kv_dtypes)
    kv = rows * (prompt_tokens + batch.new_tokens) * per_token
    transient = prompts * prompt_tokens * dtype_bytes * (4 * shape.hidden + 2 * shape.intermediate)
    if shape.is_vision:
        transient += prompts * patches * dtype_bytes * (4 * shape.vision_hidden + 2 * shape.vision_intermediate)
    prefill = float(transient + rows * shape.vocab * 4 * 4)
    if not static:
        return {"kv_cache": float(kv), "prefill": prefill}
    return {**static_decode_bytes(shape, batch, kv_dtypes, prefill), "prefill": prefill}


def static_decode_bytes(
    shape: ModelShape, batch: RolloutBatch, kv_dtypes: tuple[int, int], prefill: float
) -> dict[str, float]:
    """The static decoder's memory in an HF rollout of `batch` (`vlm_corl.members.static_decode`), keys and values
    of `kv_dtypes` bytes, beside the prefill's transient of `prefill` bytes. Nothing of it is held through the
    update: the prefix's KV is dropped once copied into the bucket, and `HFEngine.sleep` frees the buckets.

    - `static_kv_cache`: the bucket, `bucket_rows(rows)` x `bucket_length(prompt + new tokens)` positions (rows
      rounded up to a power of two, positions to a multiple of 256), in place of rows x (prompt + new tokens).
    - `static_graph_pool`: the CUDA-graph pool of the captured step's intermediates, counted as its two largest:
      the (bucket rows, vocab) logits the step returns, at 4 bytes (fp32, an upper bound of a bf16 lm_head's
      output), and one layer's K/V replicated to the query heads over the whole bucket (transformers repeats
      GQA K/V whenever a mask is passed, as the static step always does), heads x head_dim per position, in the
      cache's dtypes. The rest (one position's hidden states and MLP) is small beside them.
    - `static_prefix_kv`: the prefix's own KV (rows x prompt) exists beside the bucket while it is copied in,
      after the prefill's transient is gone: the part of it the transient does not already cover."""
    rows, length = bucket_rows(batch.prompts * batch.n), bucket_length(batch.prompt_tokens + batch.new_tokens)
    bucket = rows * length * kv_bytes_per_token(shape, *kv_dtypes)
    heads = shape.heads or shape.hidden // shape.head_dim
    pool = rows * shape.vocab * 4 + rows * length * heads * shape.head_dim * sum(kv_dtypes)
    prefix = batch.prompts * batch.n * batch.prompt_tokens * kv_bytes_per_token(shape, *kv_dtypes)
    return {
        "static_kv_cache": float(bucket),
        "static_graph_pool": float(pool),
        "static_prefix_kv": max(0.0, prefix - prefill),
    }


def vllm_kv_need(shape: ModelShape, sequences: int, max_model_len: int, dtype_bytes: int) -> tuple[float, float]:
    """(bytes of KV cache one sequence of max_model_len needs, bytes for all `sequences` in flight at once)."""
    one = max_model_len * kv_bytes_per_token(shape, dtype_bytes)
    return float(one), float(one * sequences)


def deepspeed_buffers(zero: dict, shape: ModelShape, grad_bytes: int = 4) -> dict[str, float]:
    """DeepSpeed's own buffers for a member under `zero` (its zero_optimization section), as DeepSpeed 0.19
    allocates them (measured by bench/plan_check.py): ZeRO-3 keeps a contiguous gradient bucket of
    reduce_bucket_size elements from the start (`ds_buckets`, whatever the model's size) and gathers parameters
    for each forward (`ds_gathered`: the prefetch bucket and the largest tensor, fp32); ZeRO-2 fills its bucket
    only during the backward (`ds_reduce_bucket`; two with overlap_comm)."""
    stage = zero.get("stage", 0)
    contiguous = zero.get("contiguous_gradients", True)
    bucket = int(zero.get("reduce_bucket_size", DS_DEFAULT_REDUCE_BUCKET)) * grad_bytes
    if stage == 2:
        return {"ds_reduce_bucket": float(bucket * (2 if zero.get("overlap_comm", False) else 1))} if contiguous else {}
    if stage != 3:
        return {}
    prefetch = int(zero.get("stage3_prefetch_bucket_size", DS_DEFAULT_PREFETCH))
    gathered = float(min(prefetch + shape.largest_tensor, shape.params) * 4)
    return {"ds_buckets": float(bucket), "ds_gathered": gathered} if contiguous else {"ds_gathered": gathered}


def vllm_batch_defaults(device_bytes: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM picks for a card of `device_bytes` (VLLM_BATCH_DEFAULTS)."""
    return VLLM_BATCH_DEFAULTS[device_bytes >= VLLM_LARGE_CARD_BYTES]


def vllm_activation_bytes(shape: ModelShape, device_bytes: float, dtype_bytes: int, patches: int) -> float:
    """vLLM's profiled activation peak, taken out of its share before the KV cache: one decoder layer's
    transient over max_num_batched_tokens tokens (the MLP's gate/up/activation outputs and the attention's
    tensors, as `dtype_bytes * tokens * (4 I + 8 h)`), the dummy sampler over max_num_seqs rows of the vocabulary,
    and one vision layer over an image's patches."""
    tokens, seqs = vllm_batch_defaults(device_bytes)
    forward = dtype_bytes * tokens * (4 * shape.intermediate + 8 * shape.hidden)
    sampler = VLLM_SAMPLER_BYTES_PER_LOGIT * seqs * shape.vocab
    vision = dtype_bytes * patches * (4 * shape.vision_intermediate + 8 * shape.vision_hidden) if shape.is_vision else 0
    return float(forward + sampler + vision)


def vllm_sleep_keeps(enforce_eager: bool) -> float:
    """What vLLM's sleep mode leaves on the GPU per engine (VLLM_SLEEP_KEEPS_BYTES)."""
    return VLLM_SLEEP_KEEPS_EAGER_BYTES if enforce_eager else VLLM_SLEEP_KEEPS_BYTES


def zero2_accumulation_bytes(zero: dict, trained: float, ranks: int, micro_batches: int, grad_bytes: int = 4) -> float:
    """ZeRO-2's second gradient partition during a backward after the first of a step: with contiguous_gradients
    each backward copies the gradients into a new partition-sized buffer (stage_1_and_2.py
    `copy_grads_in_partition`, after `_release_ipg_buffers` dropped the last one) while the partition accumulated
    over the earlier micro-batches is still held, 4 bytes per trained parameter over G (measured on an H200,
    DeepSpeed 0.19.8: every backward after a step's first peaks one partition above the accumulated one, plus
    the reduce bucket). 0 for one micro-batch per step, other stages, or offloaded gradients."""
    if zero.get("stage", 0) != 2 or not zero.get("contiguous_gradients", True) or "offload_optimizer" in zero:
        return 0.0
    return grad_bytes * trained / ranks if micro_batches > 1 else 0.0


def zero_step_bytes(zero: dict, trained: float, ranks: int, grad_bytes: int = 4) -> float:
    """The optimizer step's transient under ZeRO with fp32 modules: the step flattens the rank's gradient
    partition into a new fp32 tensor (stage_1_and_2.py `step`: `flatten(averaged_gradients)`, while those still
    exist; stage3.py `_prepare_fp32_grad_for_sub_group`, one sub-group at a time), 4 bytes per trained parameter
    over G beside the gradient partitions. On CUDA the client AdamW (not fused under DeepSpeed: torch's foreach
    implementation, its default for CUDA tensors) then computes sqrt(v) of that partition into one more tensor of
    the same size (`_multi_tensor_adam`: `torch._foreach_sqrt`), with the gradient partition and its flat copy
    still allocated: measured on an H200 (DeepSpeed 0.19.8), the step peaks at 3 partition-sized fp32 tensors
    over the resident states, for a 268M-parameter MLP as for Qwen2-VL-2B alone on one rank (61.9 GB = 35.3
    resident + 3 x 8.84, at two batch sizes); the planner counts it as a second item of this size
    (`cohort._update_items`). On the CPU bench/plan_check.py measures the flat copy alone. 0 without ZeRO or with
    CPU offload (the step runs on the host)."""
    stage = zero.get("stage", 0)
    if stage not in (2, 3) or "offload_optimizer" in zero:
        return 0.0
    partition = trained / ranks
    if stage == 3:
        partition = min(partition, float(zero.get("sub_group_size", DS_DEFAULT_SUB_GROUP)))
    return grad_bytes * partition

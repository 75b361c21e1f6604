"""Which precision each part of a run computes in, decided once from the config and the device (pure functions).

Real runs use bf16 compute: fp32 rollouts double the weight and KV-cache bytes and, with TF32 off, run without
tensor cores. Trainable members keep fp32 master weights whatever the checkpoint's dtype (a bf16 weight updated
at lr 1e-6 loses almost every update to rounding); compute is lowered by autocast (the update, HF rollouts and
evaluation) or by the engine's own copy (vLLM, built in the rollout dtype and fed the masters on every sync).
On a CPU the defaults keep the checkpoint's dtype, so the test suite's fp32 tiny models compute exactly.
"""

from __future__ import annotations

import copy

import torch

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def update_autocast_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the update's forward passes (`train.mixed_precision`): bf16 or None (fp32)."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if mixed_precision == "bf16" else None


def rollout_dtype(setting: str, device: torch.device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The dtype rollouts and evaluation compute in (`rollout.dtype`): auto = bf16 on CUDA, else the dtype the
    checkpoint was saved in."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else checkpoint_dtype
    return DTYPES[setting]


def serves_lower(rollout: torch.dtype, weights: torch.dtype) -> bool:
    """Whether rollouts compute below the weights' precision (fp32 weights served in bf16 or fp16)."""
    return rollout != weights and rollout in (torch.bfloat16, torch.float16)


def samples_from_copy(
    moves: bool, lora: bool, zero_stage: int | None, engine: str, rollout: torch.dtype, weights: torch.dtype
) -> bool:
    """Whether a member's HF rollouts sample from a frozen copy of its weights in the `rollout` dtype
    (`rollout_copy`, refreshed in place at every weight sync) rather than from the `weights` themselves.

    Yes for weights that `moves` (a trained member's fp32 masters, an EMA teacher's fp32 weights) served below
    their precision on the HF engine: sampling them under autocast caches fp32 keys (transformers 5.19 fp32
    values too) and keeps the static decoder from running (`index_copy_` of bf16 into an fp32 cache), and a
    compiled step re-casts every weight at every token, where the copy costs 2 bytes a parameter once. Not for
    a LoRA member (its frozen base is already in its loaded dtype), a ZeRO-3 member (its DeepSpeed engine keeps
    its own copy: `deepspeed_update.attach_deepspeed`), a vLLM engine (it holds its own weights), or a frozen
    peer (cast once at load: `cast_parameters`)."""
    return moves and not lora and zero_stage != 3 and engine == "hf" and serves_lower(rollout, weights)


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast a frozen model's floating parameters to `dtype` in place, once (a member that never trains: served
    in the rollout dtype, where autocast would recast every frozen weight at every decoded token, since it
    caches only casts of weights that require grad). Buffers keep their dtype: rotary `inv_freq` is fp32 on
    purpose (transformers upcasts it in the forward, which cannot undo a bf16 rounding)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def rollout_copy(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of `model` to sample from, on `device`: its parameters in the rollout `dtype`, its buffers
    as they are (see `cast_parameters`). Each parameter is cast as it is copied (tied ones once), so the host
    never holds a second full-precision model (an 11B member would need 44 GB more per rank). The HF engine's
    copy of a ZeRO-3 member, and of a trained member or an EMA teacher where `samples_from_copy` says so."""
    cast = {
        id(p): torch.nn.Parameter(p.detach().to(device=device, dtype=dtype), requires_grad=False)
        for p in model.parameters()
    }
    return copy.deepcopy(model, cast).eval().to(device)  # the buffers move, keeping their dtype

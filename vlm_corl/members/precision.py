"""Which precision each part of a run computes in, decided once from the config and the device (pure functions).

Real runs use bf16 compute: fp32 rollouts double the weight and KV-cache bytes and, with TF32 off, run without
tensor cores. Trainable members keep fp32 master weights whatever the checkpoint's dtype (a bf16 weight updated
at lr 1e-6 loses almost every update to rounding); compute is lowered by autocast (the update, HF rollouts and
evaluation) or by the engine's own copy (vLLM, built in the rollout dtype and fed the masters on every sync).
On a CPU the defaults keep the checkpoint's dtype, so the test suite's fp32 tiny models compute exactly.
"""

from __future__ import annotations

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

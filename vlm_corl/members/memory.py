"""The memory arithmetic of a member's states, in one place: its bytes per rank by part, from its parameter count
and how it is trained and served. The cohort planner (`vlm_corl.planning`) builds on it, adding buffers, engines,
KV caches, activations and logits per phase.

Per rank, for P parameters on a member's G ranks (what this trainer allocates; DeepSpeed 0.19 with fp32 module
weights, which is how our members train: fp32 masters, bf16 compute by autocast):
- plain data parallel: fp32 weights 4P, fp32 gradients 4P, AdamW's two fp32 moments 8P = 16P;
- ZeRO-2: the fp32 module stays whole (4P), gradients, DeepSpeed's own fp32 master copy and the moments are split
  over G: 4P + 16P/G;
- ZeRO-3: the module's fp32 partitions, the fp32 master partitions, gradients and moments all split: 20P/G; with
  the HF rollout engine also a full copy in the rollout dtype (2P in bf16); CPU offload moves the optimizer's
  part (16P/G) and, with `offload_param`, the weights (4P/G) to host memory;
- a LoRA member trains only its A adapter parameters: the states above for A, plus its frozen base in its loaded
  dtype (2P in bf16; split over G under ZeRO-3);
- a frozen peer holds its weights in its loaded dtype (2P in bf16); a KL reference the same; an EMA teacher 4P;
- a vLLM engine holds its weights in the rollout dtype (2P in bf16) besides its KV cache, which
  `rollout.vllm.gpu_memory_utilization` bounds (the planner counts that share).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

GB = 1e9  # decimal gigabytes, as GPU memory is sold
UNITS = {"": GB, "gb": GB, "g": GB, "gib": 2**30, "mb": 1e6, "mib": 2**20, "tb": 1e12, "tib": 2**40}


def memory_size(text: str) -> float:
    """argparse type: '80GB', '80GiB', '141 GB', '80' (GB) -> bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not found or found.group(2).lower() not in UNITS or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 80GB or 141GiB, got {text!r}")
    return float(found.group(1)) * UNITS[found.group(2).lower()]


@dataclass(frozen=True)
class Layout:
    """How one member is trained and served on each of its `ranks` ranks."""

    trainable: bool = True
    zero: int | None = None  # None: plain data parallel; 2 or 3: DeepSpeed ZeRO stage
    ranks: int = 1
    engine: str = "hf"  # "hf" | "vllm"
    offload_optimizer: bool = False  # ZeRO: optimizer state (and gradients) in host memory
    offload_params: bool = False  # ZeRO-3: partitioned weights in host memory
    rollout_bytes: int = 2  # bytes per parameter of the rollout dtype (bf16 on CUDA)
    frozen_bytes: int = 2  # bytes per parameter of a frozen member's loaded dtype
    kl_reference: bool = False
    ema_teacher: bool = False
    adapters: int = 0  # a LoRA member's adapter parameters (fp32, the only ones trained); 0 = full fine-tuning


def member_bytes(params: int, layout: Layout) -> dict[str, float]:
    """Bytes per rank of a member of `params` parameters, by part (see the module docstring). A LoRA member
    (`layout.adapters`) holds its frozen base in its loaded dtype (split over G under ZeRO-3) and the trained
    states above for the adapters alone."""
    p, g = float(params), layout.ranks
    parts = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "full_copy": 0.0, "engine_weights": 0.0}
    a = float(layout.adapters) if layout.trainable and layout.adapters else p  # the trained parameters
    if not layout.trainable:  # cast once at load when rollouts compute lower (a frozen fp32 peer in bf16)
        parts["weights"] = min(layout.frozen_bytes, layout.rollout_bytes) * p
    elif layout.zero is None:
        parts.update(weights=4 * a, gradients=4 * a, optimizer=8 * a)
    else:
        split = 4 * a / g  # gradients, DeepSpeed's fp32 master partition: each 4 bytes per parameter over G
        parts["weights"] = 4 * a if layout.zero == 2 else (0.0 if layout.offload_params else 4 * a / g)
        parts["gradients"] = 0.0 if layout.offload_optimizer else split
        parts["optimizer"] = 0.0 if layout.offload_optimizer else 3 * split  # master + two moments
        if layout.zero == 3 and layout.engine == "hf":
            parts["full_copy"] = layout.rollout_bytes * p
    if layout.trainable and layout.adapters:  # the frozen base beside the adapters, in its loaded dtype
        if layout.zero != 3:
            parts["weights"] += layout.frozen_bytes * p
        elif not layout.offload_params:
            parts["weights"] += layout.frozen_bytes * p / g
    if layout.engine == "vllm":
        parts["engine_weights"] = layout.rollout_bytes * p
    if layout.kl_reference:
        parts["kl_reference"] = layout.frozen_bytes * p
    if layout.ema_teacher:
        # fp32 for the EMA steps, plus what it samples from: its vLLM engine, or a copy in the rollout dtype
        copy = layout.engine == "vllm" or layout.rollout_bytes < 4
        parts["ema_teacher"] = 4 * p + (layout.rollout_bytes * p if copy else 0.0)
    return parts

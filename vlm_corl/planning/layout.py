"""A member's layout as the planner reads it from the config: the ZeRO settings, the states layout
(`vlm_corl.members.memory.Layout`), the trained parameters and the bytes per parameter of each dtype it is
loaded, served and saved in. Shared by the GPU plan (`cohort`), its vLLM engines, host memory and disk; each takes
the member's `ModelShape` from the plan's `Shapes`, read once at its start."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.schema import CohortConfig, MemberConfig, has_teachers
from vlm_corl.members.memory import Layout
from vlm_corl.members.precision import rollout_dtype
from vlm_corl.planning.shapes import DTYPE_BYTES, ModelShape, adapter_count


def zero_settings(cfg: CohortConfig) -> dict:
    """The zero_optimization section of train.deepspeed ({} without DeepSpeed)."""
    if not cfg.train.deepspeed:
        return {}
    return json.loads(Path(cfg.train.deepspeed).read_text()).get("zero_optimization", {"stage": 2})


def member_layout(
    cfg: CohortConfig, member: MemberConfig, shape: ModelShape, ranks: int, zero: dict, cuda: bool
) -> Layout:
    """The states layout (`vlm_corl.members.memory.Layout`) of `member` (of `shape`) on `ranks` ranks."""
    stage = zero.get("stage", 2) if zero and member.trainable else None
    return Layout(
        trainable=member.trainable,
        zero=stage,
        ranks=ranks,
        engine=member_engine(cfg, member),
        offload_optimizer=stage is not None and "offload_optimizer" in zero,
        offload_params=stage == 3 and "offload_param" in zero,
        rollout_bytes=rollout_bytes(cfg, shape, cuda),
        frozen_bytes=loaded_bytes(member, shape),
        kl_reference=cfg.algo.kl_beta > 0 and member.trainable,
        ema_teacher=has_teachers(cfg) and member.trainable,
        adapters=adapters(member),
    )


def adapters(member: MemberConfig) -> int:
    """The adapter parameters of a LoRA member (0 for any other)."""
    lora = member.lora
    if lora is None or not member.trainable:
        return 0
    targets = tuple(lora.target_modules) if lora.target_modules else None
    return adapter_count(str(member.model), lora.r, targets, lora.vision)


def trained_params(member: MemberConfig, shape: ModelShape) -> float:
    """Parameters `member` (of `shape`) trains: all of them, or a LoRA member's adapters."""
    return float(adapters(member) or shape.params)


def rollout_bytes(cfg: CohortConfig, shape: ModelShape, cuda: bool) -> int:
    """Bytes per parameter of the rollout dtype of a member of `shape` (rollout.dtype; auto: bf16 on CUDA, else the
    checkpoint's)."""
    device = torch.device("cuda" if cuda else "cpu")
    checkpoint = {4: torch.float32, 2: torch.bfloat16}[shape.checkpoint_bytes]
    return torch.empty(0, dtype=rollout_dtype(cfg.rollout.dtype, device, checkpoint)).element_size()


def loaded_bytes(member: MemberConfig, shape: ModelShape) -> int:
    """Bytes per parameter of a member as loaded: members[i].dtype, auto = its checkpoint's (what a frozen member
    or KL reference holds, and what a trained member's checkpoints are saved in)."""
    return shape.checkpoint_bytes if member.dtype == "auto" else DTYPE_BYTES[member.dtype]

"""The memory plan of a whole cohort on its hardware: for every rank, every member it hosts and what each part
takes (states, DeepSpeed buffers, vLLM engines and KV cache, the HF rollout's KV cache, an update's activations
and logits), the peak, the headroom left on the card, a verdict, and the changes that would make it fit.

A rank's memory is counted in three phases. Resident: what stays allocated through the step (every hosted
member's states; a vLLM engine's whole share unless sleep mode frees it during updates). Rollout and update:
what one member allocates on top while it rolls out or trains; members hosted on the same ranks take their
turns, so a phase costs its largest member. The peak is resident + the larger phase. A card is usable up to its
memory less a reserve for the CUDA context, communication buffers and allocator fragmentation (`RESERVE_*`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm_corl.config.engine_layout import engine_layout_problems, member_engine, vllm_engines_by_rank
from vlm_corl.config.schema import CohortConfig, MemberConfig, has_teachers
from vlm_corl.distributed.world import PlacementError, place_members, shard
from vlm_corl.members.memory import GB, Layout, member_bytes
from vlm_corl.members.precision import rollout_dtype, update_autocast_dtype
from vlm_corl.planning import estimates as est
from vlm_corl.planning.shapes import DTYPE_BYTES, ModelShape, adapter_count, model_shape

RESERVE_BYTES = 1e9  # CUDA context and NCCL buffers, per GPU
RESERVE_SHARE = 0.05  # allocator fragmentation: this share of the device stays out of the plan
PHASES = ("resident", "rollout", "update")
# The parts that hold a member's weights and training state (the rest: engines, KV caches, activations, logits)
STATES = ("weights", "gradients", "optimizer", "full_copy", "kl_reference", "ema_teacher", "ds_buckets")


@dataclass(frozen=True)
class Hardware:
    """What the cohort is launched on: `processes` ranks, each with `device_bytes` of memory."""

    processes: int
    device_bytes: float
    cuda: bool = True  # precision defaults follow the device (bf16 on CUDA)
    label: str = ""

    @property
    def usable_bytes(self) -> float:
        return self.device_bytes * (1 - RESERVE_SHARE) - (RESERVE_BYTES if self.cuda else 0.0)


@dataclass(frozen=True)
class Item:
    """One part of one member's memory on a rank."""

    member: str
    part: str
    bytes: float
    phase: str  # resident | rollout | update


@dataclass
class RankPlan:
    """One rank: its members' items, the peak, and what cannot work whatever the headroom (`problems`)."""

    rank: int
    members: list[str]
    items: list[Item]
    usable: float
    capacity: float
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def phase_bytes(self, phase: str) -> float:
        """Resident: the sum; rollout and update: the largest member's (members on a rank take turns)."""
        per_member: dict[str, float] = {}
        for it in self.items:
            if it.phase == phase:
                per_member[it.member] = per_member.get(it.member, 0.0) + it.bytes
        if phase == "resident":
            return sum(per_member.values())
        return max(per_member.values(), default=0.0)

    def states_bytes(self) -> float:
        """Weights and training state (`STATES`) at an optimizer step: every member's resident ones, and the
        update-time ones (ZeRO-2's gradient partitions and bucket) of the largest member."""
        resident = sum(it.bytes for it in self.items if it.part in STATES and it.phase == "resident")
        during: dict[str, float] = {}
        for it in self.items:
            if it.part in STATES and it.phase == "update":
                during[it.member] = during.get(it.member, 0.0) + it.bytes
        return resident + max(during.values(), default=0.0)

    @property
    def peak(self) -> float:
        return self.phase_bytes("resident") + max(self.phase_bytes("rollout"), self.phase_bytes("update"))

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable and not self.problems

    @property
    def largest(self) -> Item:
        return max(self.items, key=lambda it: it.bytes)

    def to_dict(self) -> dict:
        members: dict[str, dict[str, float]] = {}
        for it in self.items:
            members.setdefault(it.member, {})[f"{it.part} ({it.phase})"] = round(it.bytes / GB, 3)
        return {
            "rank": self.rank,
            "fits": self.fits,
            "peak_gb": round(self.peak / GB, 3),
            **{f"{p}_gb": round(self.phase_bytes(p) / GB, 3) for p in PHASES},
            "usable_gb": round(self.usable / GB, 3),
            "capacity_gb": round(self.capacity / GB, 3),
            "headroom_gb": round((self.usable - self.peak) / GB, 3),
            "largest": {
                "member": self.largest.member,
                "part": self.largest.part,
                "gb": round(self.largest.bytes / GB, 3),
            },
            "members": members,
            "problems": self.problems,
            "notes": self.notes,
        }


@dataclass
class CohortPlan:
    """Every rank's plan on `hardware`, for the config it was made from."""

    hardware: Hardware
    placement: dict[str, tuple[int, ...]]
    ranks: list[RankPlan]
    fixes: list[dict] = field(default_factory=list)  # `vlm_corl.planning.fixes.fixes`, when asked for

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def worst(self) -> RankPlan:
        """The rank with the least headroom (a rank with a problem first)."""
        return min(self.ranks, key=lambda r: (not r.problems, r.usable - r.peak))

    def peak_of(self, rank: int) -> float:
        return next(r.peak for r in self.ranks if r.rank == rank)

    def to_dict(self) -> dict:
        hw = self.hardware
        return {
            "hardware": {
                "processes": hw.processes,
                "device_gb": round(hw.device_bytes / GB, 3),
                "usable_gb": round(hw.usable_bytes / GB, 3),
                "cuda": hw.cuda,
                "label": hw.label,
            },
            "fits": self.fits,
            "worst_rank": self.worst.rank,
            "placement": {m: list(r) for m, r in self.placement.items()},
            "ranks": [r.to_dict() for r in self.ranks],
            "fixes": self.fixes,
        }


def zero_settings(cfg: CohortConfig) -> dict:
    """The zero_optimization section of train.deepspeed ({} without DeepSpeed)."""
    if not cfg.train.deepspeed:
        return {}
    return json.loads(Path(cfg.train.deepspeed).read_text()).get("zero_optimization", {"stage": 2})


def member_layout(cfg: CohortConfig, member: MemberConfig, ranks: int, zero: dict, cuda: bool) -> Layout:
    """The states layout (`vlm_corl.members.memory.Layout`) of `member` on `ranks` ranks."""
    shape = model_shape(str(member.model))
    stage = zero.get("stage", 2) if zero and member.trainable else None
    serving = _dtype_bytes(rollout_dtype(cfg.rollout.dtype, _device(cuda), _checkpoint_dtype(shape)))
    return Layout(
        trainable=member.trainable,
        zero=stage,
        ranks=ranks,
        engine=member_engine(cfg, member),
        offload_optimizer=stage is not None and "offload_optimizer" in zero,
        offload_params=stage == 3 and "offload_param" in zero,
        rollout_bytes=serving,
        frozen_bytes=_loaded_bytes(member, shape),
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


def plan_cohort(cfg: CohortConfig, hardware: Hardware) -> CohortPlan:
    """The memory plan of `cfg` launched on `hardware` (raises PlacementError if the members cannot be placed)."""
    placement = place_members(cfg.members, hardware.processes)
    teachers = has_teachers(cfg)
    engines = vllm_engines_by_rank(cfg, placement, teachers)
    zero = zero_settings(cfg)
    ranks = []
    for rank in range(hardware.processes):
        plan = RankPlan(rank, [], [], hardware.usable_bytes, hardware.device_bytes)
        for m in cfg.members:
            if rank in placement[m.id]:
                plan.members.append(m.id)
                _member_items(cfg, m, placement[m.id], rank, len(engines.get(rank, [])), zero, hardware, plan)
        ranks.append(plan)
    return CohortPlan(hardware, placement, ranks)


def _member_items(
    cfg: CohortConfig,
    m: MemberConfig,
    ranks: tuple[int, ...],
    rank: int,
    engines_here: int,
    zero: dict,
    hw: Hardware,
    plan: RankPlan,
) -> None:
    """Add member `m`'s items on `rank` to `plan` (and what cannot work to its problems)."""
    shape = model_shape(str(m.model))
    layout = member_layout(cfg, m, len(ranks), zero, hw.cuda)
    r, t = cfg.rollout, cfg.train
    prompts = len(shard(cfg.data.batch_size, ranks, rank))
    rows = prompts * r.n
    patches = shape.patches_per_image(cfg.data.max_image_pixels)

    def add(part: str, nbytes: float, phase: str) -> None:
        if nbytes > 0:
            plan.items.append(Item(m.id, part, float(nbytes), phase))

    for part, nbytes in member_bytes(shape.params, layout).items():
        if part not in ("engine_weights", "ema_teacher"):
            # ZeRO-2 holds its gradient partitions only from the backward to the optimizer step
            add(part, nbytes, "update" if part == "gradients" and layout.zero == 2 else "resident")
    if layout.ema_teacher:
        add("ema_teacher", 4 * shape.params, "resident")
    if m.trainable:
        compute = 2 if update_autocast_dtype(t.mixed_precision, _device(hw.cuda)) is not None else 4
        for part, nbytes in est.deepspeed_buffers(zero, shape).items():
            add(part, nbytes, "resident" if part == "ds_buckets" else "update")
        micro = min(t.micro_batch_size, rows)
        acts = est.activation_bytes(
            shape, micro * (r.max_prompt_tokens + r.max_new_tokens), micro * patches, compute, t.gradient_checkpointing
        )
        for tower, nbytes in acts.items():
            add(f"activations_{tower}", nbytes, "update")
        add("logits", est.logits_bytes(micro, r.max_new_tokens, shape.vocab, compute), "update")
        if compute == 2 and layout.zero != 3:  # autocast's bf16 casts of the fp32 weights, kept for the backward
            fp32_base = not layout.adapters or layout.frozen_bytes == 4  # a LoRA base loaded in bf16 needs none
            add("autocast_weights", 2 * ((shape.params if fp32_base else 0) + layout.adapters), "update")
    max_model_len = r.max_prompt_tokens + r.max_new_tokens
    if layout.engine == "vllm":
        _vllm_items(cfg, m, shape, layout, rows, max_model_len, engines_here, hw, plan, add)
    else:
        hf = est.hf_rollout_bytes(
            shape, prompts, r.n, r.max_prompt_tokens, r.max_new_tokens, patches, layout.rollout_bytes
        )
        for part, nbytes in hf.items():
            add(f"rollout_{part}", nbytes, "rollout")
        fp32_weights = not layout.adapters or layout.frozen_bytes == 4  # a LoRA base in bf16 samples as it is
        casts = m.trainable and layout.zero != 3 and layout.rollout_bytes < 4 and fp32_weights
        if casts:  # the rollout's autocast caches one bf16 cast of each fp32 master
            add("autocast_weights", layout.rollout_bytes * shape.params, "rollout")


def _vllm_items(cfg, m, shape, layout, rows, max_model_len, engines_here, hw, plan, add) -> None:
    """A member's vLLM engine: its share of gpu_memory_utilization (weights, then KV cache and vLLM's own
    activations); resident unless sleep mode frees it during updates (CUDA only)."""
    v = cfg.rollout.vllm
    share = 1.0 / max(engines_here, 1)
    weights = layout.rollout_bytes * shape.params
    if v.kv_cache_memory_bytes:
        kv = v.kv_cache_memory_bytes * share
    else:
        kv = v.gpu_memory_utilization * hw.device_bytes * share - weights
    phase = "rollout" if v.enable_sleep_mode and hw.cuda else "resident"
    add("vllm_weights", weights, phase)
    one, everything = est.vllm_kv_need(shape, rows, max_model_len, layout.rollout_bytes)
    if kv < one:
        plan.problems.append(
            f"member {m.id!r}: its vLLM engine's share ({v.gpu_memory_utilization:g} x {hw.device_bytes / GB:.0f} GB"
            f"{f' / {engines_here} engines' if engines_here > 1 else ''}) leaves {max(kv, 0) / GB:.1f} GB after its "
            f"{weights / GB:.1f} GB of weights, but one sequence of max_model_len {max_model_len} needs "
            f"{one / GB:.2f} GB of KV cache: raise rollout.vllm.gpu_memory_utilization or lower "
            "rollout.max_prompt_tokens / max_new_tokens"
        )
    elif kv < everything:
        plan.notes.append(
            f"member {m.id!r}: the vLLM KV cache holds {int(kv // one)} of the {rows} sequences of a step at their "
            "longest; the rest wait their turn (slower rollouts, not an error)"
        )
    add("vllm_kv_cache", max(kv, 0.0), phase)
    if layout.ema_teacher:  # the teacher's own engine on the same share
        add("teacher_vllm", v.gpu_memory_utilization * hw.device_bytes * share, phase)


def _device(cuda: bool) -> torch.device:
    return torch.device("cuda" if cuda else "cpu")


def _checkpoint_dtype(shape: ModelShape) -> torch.dtype:
    return {4: torch.float32, 2: torch.bfloat16}[shape.checkpoint_bytes]


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _loaded_bytes(member: MemberConfig, shape: ModelShape) -> int:
    """Bytes per parameter of a frozen member (or KL reference) as loaded: members[i].dtype, auto = checkpoint's."""
    return shape.checkpoint_bytes if member.dtype == "auto" else DTYPE_BYTES[member.dtype]


def with_changes(cfg: CohortConfig, changes: dict[str, Any]) -> CohortConfig:
    """`cfg` with dotted keys set (`train.micro_batch_size`, `members.1.ranks`, ...), without re-validating."""
    for key, value in changes.items():
        cfg = _set(cfg, key.split("."), value)
    return cfg


def _set(node: Any, path: list[str], value: Any) -> Any:
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        items = list(node)
        items[int(head)] = _set(items[int(head)], rest, value) if rest else value
        return items
    child = getattr(node, head)
    return dataclasses.replace(node, **{head: _set(child, rest, value) if rest else value})


def layout_problems(cfg: CohortConfig, processes: int) -> list[str]:
    """Why `cfg` cannot launch on `processes` ranks at all (placement, vLLM engine layout, batch per rank)."""
    try:
        placement = place_members(cfg.members, processes)
    except PlacementError as err:
        return [str(err)]
    teachers = has_teachers(cfg)
    problems = [f"{path}: {msg}" for path, msg in engine_layout_problems(cfg, placement, teachers)]
    widest = max(len(r) for r in placement.values())
    if cfg.data.batch_size < widest:
        problems.append(f"data.batch_size={cfg.data.batch_size} is smaller than the {widest} ranks of a member")
    return problems


def fits_after(cfg: CohortConfig, hardware: Hardware) -> CohortPlan | None:
    """The plan of `cfg` on `hardware`, or None when the layout cannot launch there (`layout_problems`)."""
    if layout_problems(cfg, hardware.processes):
        return None
    return plan_cohort(cfg, hardware)

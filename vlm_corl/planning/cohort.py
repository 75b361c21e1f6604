"""The memory plan of a whole cohort on its hardware: for every rank, every member it hosts and what each part
takes (states, DeepSpeed buffers, vLLM engines and KV cache, the HF rollout's KV cache, an update's activations
and logits), the peak, the headroom left on the card, a verdict, and the changes that would make it fit.

A rank's memory is counted in four phases. Resident: what stays allocated through the step (every hosted
member's states, Adam's moments included: they exist before any vLLM engine is built; a vLLM engine's whole
share unless sleep mode frees it during updates, and what sleep mode cannot free). Rollout, update and step:
what one member allocates on top while it rolls out, runs its forward/backward passes, or takes its optimizer
step (ZeRO's gradient partitions, the step's flat copy of them and on CUDA Adam's temporary,
`estimates.zero_step_bytes`); members hosted on the same ranks take their turns, so a phase costs its largest
member, plus what stays through every member's turn (a sleep-mode vLLM engine is awake, weights and KV cache,
through all the rollouts of a step: `Item.held`). The peak is resident + the largest phase. A card is usable up
to its memory less a reserve for the CUDA context, communication buffers and allocator fragmentation
(`RESERVE_*`). Beside the GPU plan: the host memory of every node (`host`) and the checkpoints' disk (`disk`).

A plan reads each member's model once, at its start (`shapes.cohort_shapes`), and passes those `Shapes` down to
the layout, the engines, host memory and disk (and to the plans `micro_batch_for`, `fixes` and `suggest` make
of the same members), so no part of it reads a model directory again.

Sequences count at their longest (rollout.max_prompt_tokens + max_new_tokens) and images at
data.max_image_pixels: the plan is an upper bound over any data the config admits, and as close to a run's
measured peak as those bounds are to what its data renders (the HF engine's KV cache and an update's
activations follow the batch's longest prompt, not the bound).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_corl.config.engine_layout import engine_layout_problems
from vlm_corl.config.schema import CohortConfig, MemberConfig, has_teachers
from vlm_corl.distributed.world import PlacementError, place_members, shard
from vlm_corl.members.memory import GB, Layout, member_bytes
from vlm_corl.members.precision import samples_from_copy, update_autocast_dtype
from vlm_corl.members.static_decode import use_static_cache
from vlm_corl.planning import estimates as est
from vlm_corl.planning.disk import DiskPlan, checkpoint_disk
from vlm_corl.planning.engines import TEACHER, EngineShare, SlotKV, engine_shares, slot_minimum
from vlm_corl.planning.host import HostPlan, host_memory
from vlm_corl.planning.layout import adapters, member_layout, rollout_bytes, zero_settings  # noqa: F401 (re-exported)
from vlm_corl.planning.shapes import ModelShape, Shapes, cohort_shapes

RESERVE_BYTES = 1e9  # CUDA context and NCCL buffers, per GPU
RESERVE_SHARE = 0.05  # allocator fragmentation: this share of the device stays out of the plan
PHASES = ("resident", "rollout", "update", "step")
# The parts that hold a member's weights and training state (the rest: engines, KV caches, activations, logits)
STATES = (
    "weights",
    "gradients",
    "optimizer",
    "full_copy",
    "rollout_copy",
    "kl_reference",
    "ema_teacher",
    "ema_teacher_copy",
    "ds_buckets",
)
# Update-phase parts still there at the optimizer step (the backward's activations and logits are freed by then)
STEP_KEEPS = ("gradients",)


@dataclass(frozen=True)
class Hardware:
    """What the cohort is launched on: `processes` ranks, each with `device_bytes` of memory."""

    processes: int
    device_bytes: float
    cuda: bool = True  # precision defaults follow the device (bf16 on CUDA)
    label: str = ""
    ranks_per_node: int = 0  # consecutive ranks per node (host memory is per node); 0 = all on one node

    @property
    def usable_bytes(self) -> float:
        return self.device_bytes * (1 - RESERVE_SHARE) - (RESERVE_BYTES if self.cuda else 0.0)


@dataclass(frozen=True)
class Item:
    """One part of one member's memory on a rank."""

    member: str
    part: str
    bytes: float
    phase: str  # resident | rollout | update | step
    # Held through every hosted member's turn of its phase, not only its own member's: a sleep-mode vLLM engine's
    # weights and KV cache, mapped from the sync after an update until the next update puts it to sleep.
    held: bool = False


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
    engine_shares: float = 0.0  # the vLLM engines' shares, all of which vLLM's start-up check wants free

    def phase_bytes(self, phase: str) -> float:
        """Resident: the sum; rollout, update and step: the largest member's (members on a rank take turns), plus
        the items held through every member's turn (`Item.held`). The step also holds the member's update-phase
        gradient partitions (`STEP_KEEPS`)."""
        per_member: dict[str, float] = {}
        held = 0.0
        for it in self.items:
            if it.phase == phase and it.held:
                held += it.bytes
            elif it.phase == phase or (phase == "step" and it.phase == "update" and it.part in STEP_KEEPS):
                per_member[it.member] = per_member.get(it.member, 0.0) + it.bytes
        if phase == "resident":
            return held + sum(per_member.values())
        return held + max(per_member.values(), default=0.0)

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
    def start_bytes(self) -> float:
        """When the vLLM engines start (after every trainer state, Adam's moments included): the resident states
        and each engine's whole share, which vLLM's start-up check wants free (`request_memory`); 0 without vLLM."""
        if not self.engine_shares:
            return 0.0
        states = (it.bytes for it in self.items if it.phase == "resident" and "vllm" not in it.part)
        return sum(states) + self.engine_shares

    @property
    def peak(self) -> float:
        return max(self.phase_bytes("resident") + max(self.phase_bytes(p) for p in PHASES[1:]), self.start_bytes)

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
            "vllm_start_gb": round(self.start_bytes / GB, 3),
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
    engine_slots: list[dict] = field(default_factory=list)  # vLLM's KV cache per engine slot (`engines.SlotKV`)
    host: HostPlan | None = None  # host memory per node
    disk: DiskPlan | None = None  # the checkpoints' disk
    shapes: Shapes = field(default_factory=dict, repr=False)  # the members' shapes it was planned with

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
            "vllm_kv_cache_by_slot": self.engine_slots,
            **(self.host.to_dict() if self.host else {}),
            **(self.disk.to_dict() if self.disk else {}),
            "fixes": self.fixes,
        }


@dataclass(frozen=True)
class _Launch:
    """What a member's items depend on besides the member: the config, the members' shapes, its ZeRO settings, the
    hardware, the placement, and the vLLM engines (each rank's share, and each engine slot's smallest KV cache)."""

    cfg: CohortConfig
    shapes: Shapes
    zero: dict
    hw: Hardware
    placement: dict[str, tuple[int, ...]]
    engines: dict[tuple[int, int], EngineShare]
    slots: dict[int, SlotKV]


def plan_cohort(cfg: CohortConfig, hardware: Hardware, shapes: Shapes | None = None) -> CohortPlan:
    """The memory plan of `cfg` launched on `hardware` (raises PlacementError if the members cannot be placed):
    every rank's GPU, every node's host memory and the checkpoints' disk. `train.micro_batch_size: auto` is
    planned at what a launch on `hardware` resolves it to (`micro_batch_for`). `shapes`: the members' (None: read
    here, once for the whole plan)."""
    if cfg.train.micro_batch_size == "auto":
        size, plan = micro_batch_for(cfg, hardware, shapes)
        return plan or plan_cohort(with_changes(cfg, {MICRO_BATCH: size}), hardware, shapes)
    placement = place_members(cfg.members, hardware.processes)  # a placement error before any model is read
    shapes = cohort_shapes(cfg.members) if shapes is None else shapes
    serving = {m.id: rollout_bytes(cfg, shapes[m.id], hardware.cuda) for m in cfg.members}
    shares = engine_shares(cfg, shapes, placement, hardware.device_bytes, hardware.cuda, lambda m: serving[m.id])
    slots = slot_minimum(shares)
    launch = _Launch(cfg, shapes, zero_settings(cfg), hardware, placement, shares, slots)
    ranks = []
    for rank in range(hardware.processes):
        plan = RankPlan(rank, [], [], hardware.usable_bytes, hardware.device_bytes)
        if hardware.cuda:  # vLLM's start-up check of free GPU memory (on a CPU the KV cache is a set size)
            plan.engine_shares = sum(s.share for (where, _), s in shares.items() if where == rank)
        for m in cfg.members:
            if rank in placement[m.id]:
                plan.members.append(m.id)
                _member_items(launch, m, rank, plan)
        ranks.append(plan)
    engine_slots = [s.to_dict(shares) for s in slots.values()]
    out = CohortPlan(hardware, placement, ranks, engine_slots=engine_slots, shapes=shapes)
    room = _zero2_room(launch, ranks)
    out.host = host_memory(cfg, shapes, placement, room, hardware.ranks_per_node, hardware.cuda)
    out.disk = checkpoint_disk(cfg, shapes)
    return out


MICRO_BATCH = "train.micro_batch_size"
CPU_MICRO_BATCH = 8  # auto off CUDA: the default before auto (a CPU is not faster with larger micro-batches)


def responses_per_rank(cfg: CohortConfig, processes: int) -> int:
    """The most responses one rank of a member trains in a step: a member's batch × K over its fewest ranks."""
    fewest = min(len(ranks) for ranks in place_members(cfg.members, processes).values())
    return -(-cfg.data.batch_size * cfg.rollout.n // fewest)


def micro_batch_for(
    cfg: CohortConfig, hardware: Hardware, shapes: Shapes | None = None
) -> tuple[int, CohortPlan | None]:
    """`train.micro_batch_size: auto` on `hardware`, and the plan at that size (None where none was made);
    `shapes`: the members' (None: read here, once for every size tried).

    On CUDA: the largest power of two up to `responses_per_rank` (which is tried too; a larger micro-batch holds
    nothing more) whose plan fits every rank, tried from the largest down; 1 when none fits (the memory check
    then names what else to change). Elsewhere, or where the layout cannot launch at all: `CPU_MICRO_BATCH`."""
    if not hardware.cuda or layout_problems(cfg, hardware.processes):
        return CPU_MICRO_BATCH, None
    rows = responses_per_rank(cfg, hardware.processes)
    shapes = cohort_shapes(cfg.members) if shapes is None else shapes
    plan = None
    for size in sorted({rows, *(2**i for i in range(rows.bit_length()) if 2**i <= rows)}, reverse=True):
        plan = plan_cohort(with_changes(cfg, {MICRO_BATCH: size}), hardware, shapes)
        if plan.fits:
            return size, plan
    return 1, plan


def _zero2_room(launch: _Launch, ranks: list[RankPlan]) -> dict[int, dict[str, float]]:
    """{rank: {member: GPU bytes free when its ZeRO-2 optimizer flattens its weights}}: the card less the CUDA
    context, the states of the members loaded before it on the rank (members load in turn, before any rollout
    engine or EMA teacher), and its own weights (on a CPU launch: 0, the flat copy is on the host either way)."""
    out: dict[int, dict[str, float]] = {}
    for plan in ranks:
        before = 0.0
        for member in plan.members:
            mine = [it for it in plan.items if it.member == member and it.phase == "resident" and it.part in STATES]
            own = sum(it.bytes for it in mine if it.part == "weights")
            free = launch.hw.device_bytes - RESERVE_BYTES - before - own if launch.hw.cuda else 0.0
            out.setdefault(plan.rank, {})[member] = free
            # EMA teachers and rollout copies are built with the slots, once every member has started
            before += sum(it.bytes for it in mine if it.part not in ("ema_teacher", "rollout_copy"))
    return out


def _member_items(launch: _Launch, m: MemberConfig, rank: int, plan: RankPlan) -> None:
    """Add member `m`'s items on `rank` to `plan` (and what cannot work to its problems)."""
    cfg, hw = launch.cfg, launch.hw
    ranks = launch.placement[m.id]
    shape = launch.shapes[m.id]
    layout = member_layout(cfg, m, shape, len(ranks), launch.zero, hw.cuda)
    r = cfg.rollout
    prompts = len(shard(cfg.data.batch_size, ranks, rank))

    def add(part: str, nbytes: float, phase: str, held: bool = False) -> None:
        if nbytes > 0:
            plan.items.append(Item(m.id, part, float(nbytes), phase, held))

    for part, nbytes in member_bytes(shape.params, layout).items():
        if part not in ("engine_weights", "ema_teacher"):
            # ZeRO-2 holds its gradient partitions only from the backward to the optimizer step
            add(part, nbytes, "update" if part == "gradients" and layout.zero == 2 else "resident")
    if layout.ema_teacher:
        add("ema_teacher", 4 * shape.params, "resident")
        if _copies(True, False, None, layout):  # its copy in the rollout dtype to sample from
            add("ema_teacher_copy", layout.rollout_bytes * shape.params, "resident")
    copy = _copies(m.trainable, bool(layout.adapters), layout.zero, layout)
    if copy:  # a trained member's fp32 masters sampled from their bf16 copy (`precision.samples_from_copy`)
        add("rollout_copy", layout.rollout_bytes * shape.params, "resident")
    if m.trainable:
        _update_items(launch, shape, layout, prompts * r.n, add)
    if layout.engine == "vllm":
        for (where, _), share in launch.engines.items():
            if where == rank and share.engine in (m.id, m.id + TEACHER):
                _vllm_items(launch, share, plan, add)
        return
    patches = shape.patches_per_image(cfg.data.max_image_pixels)
    batch = est.RolloutBatch(prompts, r.n, r.max_prompt_tokens, r.max_new_tokens)
    # fp32 weights sampled under autocast: left only for a LoRA member's fp32 base (a trained member's masters
    # sample from their copy, a ZeRO-3 member's from its engine's, a LoRA base in bf16 as it is)
    autocast = m.trainable and not copy and layout.zero != 3 and layout.rollout_bytes < 4 and layout.frozen_bytes == 4
    static = hw.cuda and use_static_cache(r.hf_static_cache, _device(True)) and _static_fits(m, shape)
    weights = 4 if autocast else layout.rollout_bytes
    hf = est.hf_rollout_bytes(shape, batch, patches, layout.rollout_bytes, weights, static)
    for part, nbytes in hf.items():
        add(f"rollout_{part}", nbytes, "rollout")
    if autocast:  # the rollout's autocast caches one bf16 cast of each fp32 weight
        add("autocast_weights", layout.rollout_bytes * shape.params, "rollout")


def _copies(moves: bool, lora: bool, zero: int | None, layout: Layout) -> bool:
    """`precision.samples_from_copy` for weights of `layout` that `moves` (fp32: a trained member's masters, an EMA
    teacher's weights), planned from bytes per parameter."""
    rollout = {4: torch.float32, 2: torch.bfloat16}[layout.rollout_bytes]
    return samples_from_copy(moves, lora, zero, layout.engine, rollout, torch.float32)


def _static_fits(m: MemberConfig, shape: ModelShape) -> bool:
    """Whether member `m`'s HF rollouts decode over the static cache where it is on: sdpa attention over a model
    whose self-attention it holds (`ModelShape.static_decode`)."""
    return m.attn_implementation == "sdpa" and shape.static_decode


def _update_items(launch: _Launch, shape: ModelShape, layout: Layout, rows: int, add) -> None:
    """A trainable member's update of its `rows` responses: DeepSpeed's buffers (and ZeRO-2's second gradient
    partition while micro-batches accumulate), one micro-batch's activations and logits, autocast's weight casts,
    and the optimizer step's transient (`estimates.zero_step_bytes`, phase "step")."""
    r, t, zero = launch.cfg.rollout, launch.cfg.train, launch.zero
    compute = 2 if update_autocast_dtype(t.mixed_precision, _device(launch.hw.cuda)) is not None else 4
    for part, nbytes in est.deepspeed_buffers(zero, shape).items():
        add(part, nbytes, "resident" if part == "ds_buckets" else "update")
    micro = min(t.micro_batch_size, rows)
    patches = shape.patches_per_image(launch.cfg.data.max_image_pixels)
    tokens = micro * (r.max_prompt_tokens + r.max_new_tokens)
    acts = est.activation_bytes(shape, tokens, micro * patches, compute, t.gradient_checkpointing)
    for tower, nbytes in acts.items():
        add(f"activations_{tower}", nbytes, "update")
    add("logits", est.logits_bytes(micro, r.max_new_tokens, shape.vocab, compute), "update")
    if compute == 2 and layout.zero != 3:  # autocast's bf16 casts of the fp32 weights, kept for the backward
        fp32_base = not layout.adapters or layout.frozen_bytes == 4  # a LoRA base loaded in bf16 needs none
        add("autocast_weights", 2 * ((shape.params if fp32_base else 0) + layout.adapters), "update")
    if layout.zero is not None:
        trained = float(layout.adapters or shape.params)
        add("ds_gradient_copy", est.zero2_accumulation_bytes(zero, trained, layout.ranks, -(-rows // micro)), "update")
        flat = est.zero_step_bytes(zero, trained, layout.ranks)
        add("step_flat_gradients", flat, "step")
        if launch.hw.cuda:  # the foreach AdamW's sqrt(v) of the same partition, beside it (`zero_step_bytes`)
            add("step_adam_temporary", flat, "step")


def _vllm_items(launch: _Launch, share: EngineShare, plan: RankPlan, add) -> None:
    """One vLLM engine of the member (or its EMA teacher): its weights, profiled activations and KV cache within
    its share, resident unless sleep mode frees them during updates (CUDA only), and what sleep mode keeps. The KV
    cache is the smallest of the engine's slot over the ranks (vLLM's launcher takes the minimum).

    With sleep mode the engine sleeps only for the update: it wakes at the sync after it and stays awake through
    the next step's rollouts and in-loop evaluation (training/phases/update_phase.py: update_phase, sync_phase), so its
    weights and KV cache (CuMem allocations outside PyTorch's) are held while every other member on the rank rolls out
    (`Item.held`); only its profiled activations come and go with its own generate."""
    v, hw = launch.cfg.rollout.vllm, launch.hw
    slot = launch.slots[share.slot]
    phase = "rollout" if v.enable_sleep_mode and hw.cuda else "resident"
    prefix = "teacher_vllm" if share.engine.endswith(TEACHER) else "vllm"
    add(f"{prefix}_weights", share.weights, phase, held=True)
    add(f"{prefix}_activations", share.activations, phase)
    add(f"{prefix}_graphs", share.sleep_keeps, "resident")
    add(f"{prefix}_kv_cache", max(slot.kv, 0.0), phase, held=True)
    engines = sum(1 for (r, _) in launch.engines if r == share.rank)
    where = "" if slot.rank == share.rank else (
        f", the smallest of engine slot {share.slot} (rank {slot.rank}'s {slot.engine}: vLLM's launcher gives every "
        "rank's engine the minimum)"
    )  # fmt: skip
    if slot.kv < share.one_sequence:
        plan.problems.append(
            f"engine {share.engine!r}: its vLLM share ({v.gpu_memory_utilization:g} x {hw.device_bytes / GB:.0f} GB"
            f"{f' / {engines} engines' if engines > 1 else ''}) leaves {max(slot.kv, 0) / GB:.1f} GB of KV cache"
            f"{where} after {share.weights / GB:.1f} GB of weights, {share.activations / GB:.1f} GB of profiled "
            f"activations and {share.sleep_keeps / GB:.1f} GB of CUDA graphs and buffers, but one sequence of "
            f"max_model_len {launch.cfg.rollout.max_prompt_tokens + launch.cfg.rollout.max_new_tokens} needs "
            f"{share.one_sequence / GB:.2f} GB: raise rollout.vllm.gpu_memory_utilization or lower "
            "rollout.max_prompt_tokens / max_new_tokens"
        )
        return
    if slot.rank != share.rank and share.own_kv - slot.kv > 0.01 * GB:
        plan.notes.append(
            f"engine {share.engine!r}: its KV cache is {slot.kv / GB:.1f} GB{where}, not the "
            f"{share.own_kv / GB:.1f} GB its own share leaves"
        )
    if slot.kv < share.all_sequences:
        rows = round(share.all_sequences / share.one_sequence)
        plan.notes.append(
            f"engine {share.engine!r}: the vLLM KV cache holds {int(slot.kv // share.one_sequence)} of the {rows} "
            "sequences of a step at their longest; the rest wait their turn (slower rollouts, not an error)"
        )


def _device(cuda: bool) -> torch.device:
    return torch.device("cuda" if cuda else "cpu")


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


def fits_after(cfg: CohortConfig, hardware: Hardware, shapes: Shapes | None = None) -> CohortPlan | None:
    """The plan of `cfg` on `hardware`, or None when the layout cannot launch there (`layout_problems`);
    `shapes`: its members' (None: read here)."""
    if layout_problems(cfg, hardware.processes):
        return None
    return plan_cohort(cfg, hardware, shapes)

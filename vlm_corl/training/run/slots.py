"""Cohort slots: who renders, rolls out and receives a label each step.

A slot is one (model, view) pair taking part in a step: its rows in the exchange, the reward and the metrics
are keyed by the slot id. Usually there is one slot per member. Two single-model baselines give every member
a pair of slots (2k, 2k+1), each labelled by its partner (`rewards.paired_reward`): `co_rewarding_1` renders the
member in two views (the original wording and its paraphrase view, `paraphrase:1` when the member's own view
is the original), and `co_rewarding_2` pairs it with a slowly updated EMA copy of itself (its teacher). Slots of
one member share its engine; the update phase trains each member once, on the sequences of all its slots.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlm_corl.config.engine_layout import member_engine
from vlm_corl.data.records import ViewError, parse_view
from vlm_corl.members.engines import RolloutEngine, make_engine
from vlm_corl.members.member import Member, load_member
from vlm_corl.members.precision import rollout_copy, samples_from_copy
from vlm_corl.members.render import Renderer, Wording

if TYPE_CHECKING:
    from vlm_corl.config.schema import CohortConfig, MemberConfig
    from vlm_corl.data.records import Example

TEACHER_SUFFIX = ".teacher"


@dataclass(frozen=True)
class SlotSpec:
    """A slot as every rank knows it from the config alone (whether or not it hosts the slot's member)."""

    id: str
    member_id: str  # the member whose ranks host the slot (a teacher lives with its student)
    view: str
    teacher: bool = False  # the member's EMA teacher (co_rewarding_2) rather than the member itself


@dataclass
class Slot:
    """One (model, view) pair in the step, hosted by this process; `member` may be shared with another slot."""

    index: int  # position among all the cohort's slots (`slot_specs`): rows of the exchange and the reward
    id: str
    member: Member
    view: str
    engine: RolloutEngine
    renderer: Renderer
    follows: Member | None = None  # an EMA teacher's student: its weights move toward them after each update


def owner(slot: Slot) -> str:
    """The member whose ranks host `slot` (a teacher lives with its student)."""
    return slot.follows.id if slot.follows is not None else slot.member.id


def slot_specs(member_cfgs: Sequence[MemberConfig], layout: str) -> list[SlotSpec]:
    """Every slot of the cohort, in exchange order, for a reward layout ("members", "two_views", "ema_teacher")."""
    if layout == "members":
        return [SlotSpec(m.id, m.id, m.view) for m in member_cfgs]
    specs = []
    for m in member_cfgs:
        if layout == "two_views":
            second = m.view if m.view != "original" else "paraphrase:1"
            specs += [SlotSpec(f"{m.id}@original", m.id, "original"), SlotSpec(f"{m.id}@{second}", m.id, second)]
        elif layout == "ema_teacher":
            specs += [SlotSpec(m.id, m.id, m.view), SlotSpec(m.id + TEACHER_SUFFIX, m.id, m.view, teacher=True)]
        else:
            raise ValueError(f"unknown cohort layout {layout!r}")
    return specs


def build_slots(
    cfg: CohortConfig, members: list[Member], specs: list[SlotSpec], max_images: int, resume_from: Path | None
) -> list[Slot]:
    """The slots of `specs` whose member this process hosts (`members`), with their engines (each member's own:
    members[i].engine or rollout.engine) and renderers; builds an EMA teacher where a slot is one. Engines are
    built in the order `config.engine_layout.vllm_engines_by_rank` counts them: members, then teachers, after
    the trained members' rollout copies (`keep_rollout_copy`), which a vLLM engine's memory check then sees."""
    local = {m.id: m for m in members}
    kind = {m.id: member_engine(cfg, m.cfg) for m in members}
    for m in members:
        keep_rollout_copy(m, kind[m.id])
    teachers = [spec.member_id for spec in specs if spec.teacher and spec.member_id in local]
    # The vLLM engines of this process share its device: each gets an equal part of the memory budget.
    share = 1.0 / max(1, sum(kind[mid] == "vllm" for mid in [*local, *teachers]))

    def engine_for(model: Member, engine_kind: str) -> RolloutEngine:
        return make_engine(engine_kind, model, cfg.rollout, max_images, share, cfg.data.max_image_pixels)

    engines = {m.id: engine_for(m, kind[m.id]) for m in members}
    slots = []
    for index, spec in enumerate(specs):
        member = local.get(spec.member_id)
        if member is None:
            continue
        model, engine, follows = member, engines[member.id], None
        if spec.teacher:
            model = load_teacher(member, resume_from, hf_rollouts=kind[member.id] == "hf")
            engine, follows = engine_for(model, kind[member.id]), member
        renderer = Renderer(
            model,
            cfg.data.view_fallback,
            cfg.data.max_image_pixels,
            cfg.rollout.max_prompt_tokens,
            Wording(view=spec.view),
            cache_bytes=int(cfg.data.prompt_cache_mb * (1 << 20)),
        )
        slots.append(Slot(index, spec.id, model, spec.view, engine, renderer, follows))
    return slots


def check_views(examples: Sequence[Example], slots: Sequence[SlotSpec | Slot], fallback: str) -> dict[str, int]:
    """How many examples lack each slot's view. With data.view_fallback=error, any gap stops the run before
    the first step (not halfway through an epoch); with "original" those examples use the original wording."""
    missing = {}
    for s in slots:
        k = parse_view(s.view)
        lacking = [ex.id for ex in examples if k > len(ex.paraphrases)]
        if lacking:
            missing[s.id] = lacking
    if missing and fallback == "error":
        detail = "; ".join(f"{sid}: {len(ids)} of {len(examples)} (e.g. {ids[0]!r})" for sid, ids in missing.items())
        raise ViewError(
            f"training examples lack the view a slot renders ({detail}). Give the data paraphrases "
            "(data.paraphrases, made by `corl paraphrase`), pick another view, or set "
            "data.view_fallback=original to use the original wording for those examples"
        )
    return {sid: len(ids) for sid, ids in missing.items()}


def keep_rollout_copy(member: Member, engine: str) -> None:
    """Give a trained member on the `engine` its rollout-dtype copy to sample from where
    `precision.samples_from_copy` says so (plain or ZeRO-2 full fine-tuning of fp32 masters served in bf16 by the
    HF engine): built once, after its trainer state is restored when resuming, and refreshed in place at every
    sync (`Member.refresh_rollout_copy`). The update and the checkpoints keep reading the masters."""
    stage = member.deepspeed.stage if member.deepspeed is not None else None
    weights = next(member.model.parameters()).dtype
    lora = member.peft is not None
    if samples_from_copy(member.cfg.trainable, lora, stage, engine, member.rollout_dtype, weights):
        member.rollout_copy = rollout_copy(member.model, member.device, member.rollout_dtype)
        if member.deepspeed is not None:
            # the copy took along the forward prologue and epilogue ZeRO-2's engine hooks onto the module it wraps
            # (memory logs, profilers, its step bookkeeping): no engine's business in a rollout, and Python that
            # a compiled static step would break its graph on
            for hooks in (member.rollout_copy._forward_pre_hooks, member.rollout_copy._forward_hooks):
                hooks.clear()


def load_teacher(student: Member, resume_from: Path | None, hf_rollouts: bool = True) -> Member:
    """The EMA teacher: the student's initial weights, or the teacher saved in the checkpoint when resuming.
    With `hf_rollouts` (the HF engine) and a rollout dtype below fp32 it also gets a copy in that dtype to
    sample from, refreshed at every sync (a vLLM engine keeps its own)."""
    cfg = replace(student.cfg, id=student.id + TEACHER_SUFFIX, trainable=False, lora=None)
    source = resume_from / cfg.id if resume_from else student.cfg.model
    teacher = load_member(cfg, source, student.device, rollout="float32")  # the weights as saved, not cast
    # fp32 like its student: an EMA step of (1 - 0.9999) x a small difference vanishes in bf16 rounding. It
    # rolls out and is saved like its student (rollout and checkpoint dtypes).
    teacher.model.float().eval()
    teacher.checkpoint_dtype, teacher.rollout_dtype = student.checkpoint_dtype, student.rollout_dtype
    if samples_from_copy(True, False, None, "hf" if hf_rollouts else "vllm", teacher.rollout_dtype, torch.float32):
        teacher.rollout_copy = rollout_copy(teacher.model, teacher.device, teacher.rollout_dtype)
    return teacher


def teacher_decay(step: int, max_steps: int, start: float, end: float) -> float:
    """EMA decay at `step` on a cosine schedule from `start` (step 0) to `end` (the last step)."""
    progress = min(step / max(max_steps - 1, 1), 1.0)
    return end - (end - start) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student_weights: Iterable[tuple[str, torch.Tensor]], decay: float) -> None:
    """teacher <- decay * teacher + (1 - decay) * student, parameter by parameter; `student_weights` is the
    student's (name, tensor) stream (`Member.full_weights`), whose buffers are left alone."""
    params = dict(teacher.named_parameters())
    for name, s in student_weights:
        if name in params:
            params[name].lerp_(s.to(params[name].device), 1.0 - decay)


def models_to_save(slots: list[Slot]) -> list[Member]:
    """Every distinct model of the slots (members and teachers), each saved once per checkpoint."""
    seen: dict[int, Member] = {}
    for s in slots:
        seen.setdefault(id(s.member), s.member)
    return list(seen.values())

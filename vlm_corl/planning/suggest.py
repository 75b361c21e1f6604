"""The cheapest layout that fits a cohort on given hardware: ranks per member, ZeRO stage, micro-batch, gradient
checkpointing and vLLM sleep mode, searched over every way of giving the members disjoint groups of the ranks
(or all of them the same ranks, hosted in turn) and every setting, each one planned.

"Cheapest" is a rough step-time model, not a measurement: a rank group's time is the parameters it trains per
rank (members sharing a group add up), times 4/3 with gradient checkpointing (a second forward), 1.1 under
ZeRO-3 (its gathers) and 2 with CPU offload (CPU Adam); the slowest group sets the step. Among equal times the
fewest compromises win (no offload, no checkpointing, the lowest ZeRO stage, the largest micro-batch, no sleep).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.schema import CohortConfig
from vlm_corl.planning.cohort import CohortPlan, Hardware, fits_after, with_changes
from vlm_corl.planning.fixes import ZERO_PRESETS, preset_path, yaml_value
from vlm_corl.planning.shapes import Shapes

MAX_SPLITS = 5000  # rank splits tried at most (compositions of the ranks over the members)


@dataclass
class Suggestion:
    """A layout that fits: the changes to the cohort file and its plan."""

    changes: dict[str, Any]
    plan: CohortPlan
    step_cost: float  # the model above, relative: trained parameters per rank of the slowest group

    def overrides(self) -> list[str]:
        """The changes as dotted overrides (`python -m vlm_corl.train --config FILE ...`)."""
        return [f"{k}={yaml_value(v)}" for k, v in self.changes.items()]

    def yaml_lines(self, cfg: CohortConfig) -> list[str]:
        """The changes as lines to paste into the cohort file."""
        lines, sections = [], {}
        ranks = {int(k.split(".")[1]): v for k, v in self.changes.items() if k.startswith("members.")}
        if ranks:
            lines.append("members:")
            for i, m in enumerate(cfg.members):
                lines.append(f"  - id: {m.id}          # ... the rest of the member as it is")
                mine = ranks.get(i, m.ranks)  # a member the suggestion leaves where it is keeps its ranks
                if mine is not None:
                    lines.append(f"    ranks: [{', '.join(str(r) for r in mine)}]")
        for key, value in self.changes.items():
            if key.startswith("members."):
                continue
            *path, leaf = key.split(".")
            sections.setdefault(tuple(path), []).append((leaf, value))
        for path, leaves in sections.items():
            for depth, name in enumerate(path):
                lines.append("  " * depth + f"{name}:")
            for leaf, value in leaves:
                shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
                lines.append("  " * len(path) + f"{leaf}: {shown}")
        return lines


def compositions(total: int, parts: int):
    """Every way of writing `total` as `parts` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def rank_splits(n_members: int, processes: int) -> list[list[list[int]] | None]:
    """Candidate members[i].ranks: None (the cohort file's own placement), every member on every rank, and every
    split of the ranks into consecutive disjoint groups, one per member."""
    splits: list[list[list[int]] | None] = [None, [list(range(processes))] * n_members]
    if processes >= n_members:
        for sizes in itertools.islice(compositions(processes, n_members), MAX_SPLITS):
            starts = list(itertools.accumulate([0, *sizes[:-1]]))
            splits.append([list(range(s, s + k)) for s, k in zip(starts, sizes)])
    return splits


def step_cost(cfg: CohortConfig, plan: CohortPlan, zero: tuple[int, bool], checkpointing: bool) -> float:
    """The relative step time of the module docstring's model (the members' sizes: `plan.shapes`)."""
    groups: dict[tuple[int, ...], float] = {}
    for m in cfg.members:
        if m.trainable:
            ranks = plan.placement[m.id]
            groups[ranks] = groups.get(ranks, 0.0) + plan.shapes[m.id].params / len(ranks)
    factor = (4 / 3 if checkpointing else 1.0) * (1.1 if zero[0] == 3 else 1.0) * (2.0 if zero[1] else 1.0)
    return max(groups.values(), default=0.0) * factor


def suggest(cfg: CohortConfig, hardware: Hardware) -> Suggestion | None:
    """The cheapest layout of `cfg` that fits `hardware` (see the module docstring), or None."""
    zeros = [(None, (0, False))] + [(preset_path(name), (stage, off)) for name, stage, off in ZERO_PRESETS]
    micro = [cfg.train.micro_batch_size]
    while micro[-1] != "auto" and micro[-1] > 1:  # auto: each layout's plan takes the largest that fits
        micro.append(micro[-1] // 2)
    vllm = hardware.cuda and any(member_engine(cfg, m) == "vllm" for m in cfg.members)
    shapes: Shapes | None = None  # the members' models, read by the first layout planned and passed to the rest
    best: tuple | None = None
    for split in rank_splits(len(cfg.members), hardware.processes):
        for (deepspeed, zero), gc, mb, sleep in itertools.product(zeros, (False, True), micro, (False, True)):
            if sleep and not vllm:
                continue
            changes: dict[str, Any] = {}
            if split is not None:
                changes.update({f"members.{i}.ranks": ranks for i, ranks in enumerate(split)})
            changes.update(
                {
                    "train.deepspeed": deepspeed,
                    "train.gradient_checkpointing": gc,
                    "train.micro_batch_size": mb,
                }
            )
            if vllm:
                changes["rollout.vllm.enable_sleep_mode"] = sleep
            plan = fits_after(with_changes(cfg, changes), hardware, shapes)
            if plan is None:
                continue
            shapes = plan.shapes
            if not plan.fits:
                continue
            cost = step_cost(cfg, plan, zero, gc)
            key = (
                round(cost, -int(f"{cost:e}".split("e")[1]) + 2) if cost else 0.0,
                zero[1],
                gc,
                zero[0],
                sleep,
                -mb if mb != "auto" else 0,
                split is not None,
            )
            if best is None or key < best[0]:
                best = (key, Suggestion(changes, plan, cost))
    if best is None:
        return None
    found = best[1]
    found.changes = {k: v for k, v in found.changes.items() if value_at(cfg, k) != v}  # what the file changes
    return found


def value_at(cfg: CohortConfig, key: str) -> Any:
    """The value of a dotted key (`train.micro_batch_size`, `members.1.ranks`) in `cfg`."""
    node: Any = cfg
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node

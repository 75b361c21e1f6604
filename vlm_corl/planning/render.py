"""A cohort plan as text a person reads: one block per group of identical ranks, each member's parts, the peak
against the card, the verdict with its largest item, and the changes that would make it fit."""

from __future__ import annotations

from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import PHASES, CohortPlan, RankPlan

SHORT = {"resident": "", "rollout": " (rollout)", "update": " (update)", "step": " (step)"}


def _span(ranks: list[int]) -> str:
    return (
        f"rank {ranks[0]}"
        if len(ranks) == 1
        else f"ranks {ranks[0]}-{ranks[-1]}"
        if ranks == list(range(ranks[0], ranks[-1] + 1))
        else "ranks " + ",".join(map(str, ranks))
    )


def _signature(r: RankPlan) -> tuple:
    return (
        tuple(r.members),
        tuple((it.member, it.part, round(it.bytes), it.phase) for it in r.items),
        tuple(r.problems),
    )


def verdict_line(plan: CohortPlan) -> str:
    """One line: fits, or which rank does not and its largest item."""
    worst = plan.worst
    if plan.fits:
        return (
            f"fits: the tightest rank ({worst.rank}) peaks at {worst.peak / GB:.1f} GB of {worst.usable / GB:.1f} "
            + ("usable")
        )
    big = worst.largest
    why = (
        worst.problems[0]
        if worst.problems
        else (
            f"rank {worst.rank} peaks at {worst.peak / GB:.1f} GB of {worst.usable / GB:.1f} usable "
            f"({(worst.peak - worst.usable) / GB:.1f} GB over)"
        )
    )
    return f"does not fit: {why}; largest item: {big.member} {big.part} {big.bytes / GB:.1f} GB"


def render_plan(plan: CohortPlan, name: str = "cohort") -> str:
    """The plan as text (see the module docstring)."""
    hw = plan.hardware
    lines = [
        f"memory plan of {name} on {hw.label or f'{hw.processes} ranks'}: {hw.device_bytes / GB:.1f} GB per rank, "
        f"{hw.usable_bytes / GB:.1f} GB usable (less the reserve for the CUDA context, communication buffers and "
        "fragmentation); rollout, update and optimizer-step parts are counted for the member whose turn it is, "
        "a sleep-mode vLLM engine's weights and KV cache (held) through every member's rollout"
    ]
    groups: dict[tuple, list[RankPlan]] = {}
    for r in plan.ranks:
        groups.setdefault(_signature(r), []).append(r)
    for same in groups.values():
        r = same[0]
        phases = ", ".join(f"{p} {r.phase_bytes(p) / GB:.1f}" for p in PHASES)
        phases += f", vLLM start-up {r.start_bytes / GB:.1f}" if r.start_bytes else ""
        state = "fits" if r.fits else "DOES NOT FIT"
        lines.append(
            f"{_span([x.rank for x in same])}: peak {r.peak / GB:.1f} GB ({phases}), headroom "
            f"{(r.usable - r.peak) / GB:.1f} GB: {state}"
        )
        for member in r.members:
            parts = [
                f"{it.part}{SHORT[it.phase]}{' (held)' * it.held} {it.bytes / GB:.2f}"
                for it in r.items
                if it.member == member
            ]
            lines.append(f"    {member}: " + ", ".join(parts))
        lines += [f"    problem: {p}" for p in r.problems] + [f"    note: {n}" for n in r.notes]
    lines += _vllm_slot_lines(plan)
    lines += [x.line() for x in (plan.host, plan.disk) if x is not None]
    lines.append(verdict_line(plan))
    for fix in plan.fixes:
        where = f" on {fix['launch']}" if "launch" in fix else ""
        lines.append(
            f"  - {fix['change']}{where}: saves {fix['saves_gb']:.1f} GB on the tightest rank "
            f"(peak {fix['peak_gb']:.1f} GB){', fits' if fix['fits'] else ''}: {' '.join(fix['overrides'])}"
        )
    return "\n".join(lines)


def _vllm_slot_lines(plan: CohortPlan) -> list[str]:
    """One line per vLLM engine slot of a multi-rank launch: the KV cache every rank's engine of it gets."""
    if plan.hardware.processes < 2:
        return []
    return [
        f"vLLM engine slot {s['slot']}: every rank's engine gets {s['kv_cache_gb']:.1f} GB of KV cache (the smallest, "
        f"rank {s['set_by']['rank']}'s {s['set_by']['engine']}){'' if s['holds_one_sequence'] else ': too small'}"
        for s in plan.engine_slots
    ]

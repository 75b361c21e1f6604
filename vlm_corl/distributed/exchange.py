"""The exchange phase: every slot's per-response results reach every rank.

Each rank contributes the rows of the slots it hosts, for the batch positions it rolled out, through one
`all_gather_object` over the world group (in a single process the exchange only assembles). Rows are keyed
by (slot, batch position), never by example id: a batch may hold one example twice, and positions are what
the reward lines up. Every rank also sends the example ids of its batch, so a rank whose data order drifted
(a broken lockstep) stops the step loudly instead of mixing up labels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_corl.distributed.world import World


class LockstepError(RuntimeError):
    """Ranks or slots did not answer the same examples at the same step."""


Row = tuple[list, ...]  # per-response fields of one group, e.g. (answers, format flags, texts), K each


def exchange(world: World, batch_ids: list[str], local: dict[str, dict[int, Row]], slot_ids: list[str]) -> list[list]:
    """Gather rows {slot id: {batch position: (field_1, field_2, …)}} from every rank.

    Returns one (N, B, K) nested list per field, in `slot_ids` × batch-position order.
    """
    parts = world.all_gather({"batch": batch_ids, "rows": local})
    for rank, part in enumerate(parts):
        if part["batch"] != batch_ids:
            raise LockstepError(
                f"rank {rank} drew other examples than rank {world.rank} at this step (e.g. "
                f"{_first_difference(part['batch'], batch_ids)}): every rank must see the same data in the same "
                "order; check data.* and the code version are identical on every node"
            )
    merged: dict[str, dict[int, Row]] = {s: {} for s in slot_ids}
    for rank, part in enumerate(parts):
        for slot, rows in part["rows"].items():
            if slot not in merged:
                raise LockstepError(
                    f"rank {rank} sent answers of slot {slot!r}, which is not one of the cohort's "
                    f"{slot_ids}: every rank must run the same config and code version"
                )
            merged[slot].update(rows)
    positions = range(len(batch_ids))
    fields: list[list] | None = None
    for slot in slot_ids:
        rows = merged[slot]
        missing = [p for p in positions if p not in rows]
        extra_pos = sorted(set(rows) - set(positions))
        if missing or extra_pos:
            raise LockstepError(
                f"slot {slot!r} has no answers for batch positions {missing[:5]} (unexpected: {extra_pos[:5]}): "
                "every slot must answer every position of the step's batch; check members[*].ranks"
            )
        per_position = [rows[p] for p in positions]
        fields = fields or [[] for _ in per_position[0]]
        for f, values in enumerate(fields):
            values.append([row[f] for row in per_position])
    return fields


def _first_difference(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"position {i}: {x!r} vs {y!r}"
    return f"{len(a)} vs {len(b)} examples"

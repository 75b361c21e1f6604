"""The exchange phase: every member's extracted answers reach every other member.

Members on disjoint groups of ranks contribute their rows through one `all_gather_object` over the default
process group; in a single process all members are local and the exchange only assembles. Either way the
rows are keyed by (member, example id) and laid out in the batch's example order, so a member that answered
different examples than its peers (a broken lockstep) fails the step loudly instead of mixing up labels.
"""

from __future__ import annotations

import torch.distributed as dist


class LockstepError(RuntimeError):
    """Members did not answer the same examples at the same step."""


Row = tuple[list, ...]  # per-response fields of one group, e.g. (answers, format flags, texts), K each


def exchange(batch_ids: list[str], local: dict[str, dict[str, Row]], member_ids: list[str]) -> list[list]:
    """Gather rows {member: {example_id: (field_1, field_2, …)}} from every rank.

    Returns one (N, B, K) nested list per field, in `member_ids` × `batch_ids` order.
    """
    merged: dict[str, dict[str, Row]] = {m: {} for m in member_ids}
    parts = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    for part in parts:
        for member, rows in part.items():
            merged[member].update(rows)
    fields: list[list] | None = None
    for member in member_ids:
        rows = merged[member]
        missing = [i for i in batch_ids if i not in rows]
        extra = sorted(set(rows) - set(batch_ids))
        if missing or extra:
            raise LockstepError(
                f"member {member!r} answered a different set of examples than the step's batch "
                f"(missing {missing[:3]}, unexpected {extra[:3]}): every member must see the same example ids "
                "in the same order (one data seed); check data.* is identical on every rank"
            )
        per_example = [rows[i] for i in batch_ids]
        fields = fields or [[] for _ in per_example[0]]
        for f, values in enumerate(fields):
            values.append([row[f] for row in per_example])
    return fields

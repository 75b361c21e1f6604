"""Config keys that were renamed or removed: one table, so a cohort file written for an earlier version fails
with the new spelling in the message (exit 2), not a bare "unknown key". Add a row whenever a field of
vlm_corl.config.schema is renamed or dropped (tests/test_config.py checks that no row names a live field)."""

from __future__ import annotations

import re

# dotted path (list items as `[]`) -> what to write instead
RENAMED = {
    "logging.tensorboard": "logging.report_to: write `report_to: [tensorboard]` for event files, `[]` for none "
    "(TensorBoard, W&B, trackio and MLflow are each one entry of that list)",
    "members[].num_processes": "members[].ranks: the processes a member occupies are listed there, e.g. "
    "`ranks: [0, 1]` (or leave it out and let the launcher's processes be shared out)",
    "members[].deepspeed": "train.deepspeed: one DeepSpeed JSON config for every trained member",
}


def renamed_hint(path: str) -> str | None:
    """The message for a key this table knows (`members[2].num_processes` is looked up as `members[].…`)."""
    generic = re.sub(r"\[\d+\]", "[]", path)
    instead = RENAMED.get(generic)
    if instead is None:
        return None
    return f"{path!r} was renamed or removed; use {instead}"

"""Which family serves a checkpoint: the registered family of its config.json `model_type`, else the generic one."""

from __future__ import annotations

import json
from pathlib import Path

from vlm_corl.members.families.base import Family, family_for_model_type
from vlm_corl.members.families.generic import GENERIC, check_servable, generic_family


def detect_family(model_dir: str | Path, family: str | None = None) -> Family:
    """The family of the member saved in `model_dir`: `family: generic` when asked for, else the registered family
    of its config.json `model_type`, else the generic family when it can serve the checkpoint.

    Raises OSError/KeyError/ValueError (unreadable config.json, no `model_type`) and ValueError naming what the
    generic family would need (`generic.check_servable`)."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    if family != GENERIC:
        try:
            return family_for_model_type(model_type)
        except ValueError:
            pass  # no registered family: the generic one, if it can serve the checkpoint
    check_servable(model_dir, model_type)
    return generic_family(model_type)

"""Which family serves a checkpoint: the registered family of its config.json `model_type`, else the generic one."""

from __future__ import annotations

import json
from pathlib import Path

from vlm_corl.members.families.base import Family, family_for_model_type
from vlm_corl.members.families.generic import (
    GENERIC,
    check_servable,
    generic_family,
    remote_auto_class,
    ships_own_code,
)


def detect_family(model_dir: str | Path, family: str | None = None, trust_remote_code: bool = False) -> Family:
    """The family of the member saved in `model_dir`: `family: generic` when asked for, else the registered family
    of its config.json `model_type`, else the generic family when it can serve the checkpoint: through the Auto
    classes of this transformers, or through the checkpoint's own modelling code (config.json `auto_map`), which
    only `trust_remote_code` allows.

    Raises OSError/KeyError/ValueError (unreadable config.json, no `model_type`) and ValueError naming what the
    generic family would need (`generic.check_servable`) or that the checkpoint's own code needs
    `trust_remote_code` (`generic.remote_auto_class`)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_type = config["model_type"]
    if family != GENERIC:
        try:
            return family_for_model_type(model_type)
        except ValueError:
            pass  # no registered family: the generic one, if it can serve the checkpoint
    if ships_own_code(config):
        generic = generic_family(model_type, remote_auto_class(model_type, config["auto_map"], trust_remote_code))
        check_servable(model_dir, model_type, generic)
        return generic
    check_servable(model_dir, model_type)
    return generic_family(model_type)

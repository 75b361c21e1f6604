"""Which model directories hold a LoRA adapter, and the base model an adapter names: file checks only, so that
the config layer and the commands' argument checks need no torch (`vlm_corl.members.lora` is the rest)."""

from __future__ import annotations

import json
from pathlib import Path

from vlm_corl.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a PEFT adapter (a LoRA member's checkpoint) rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_model_dir(adapter_dir: str | Path) -> Path:
    """The base model an adapter directory was trained on (its adapter_config.json's base_model_name_or_path;
    a relative path is read from the working directory, as members[i].model is)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(
            f"{path}: not a readable PEFT adapter config ({err}); it must name base_model_name_or_path"
        ) from err
    if not base or not Path(base).is_dir():
        raise UserError(
            f"{path}: its base model {base!r} is not a directory here; the adapter is applied to that model "
            "(edit base_model_name_or_path to where the base model is)"
        )
    return Path(base)

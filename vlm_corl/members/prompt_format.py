"""The prompt format a member was trained with, kept beside its exported weights (prompt_format.json), so that
`corl eval` asks an exported model exactly as training asked it, and a transformers user can read it.

    {"prompt_style": "answer_tags",
     "instruction": "{question}\nFirst think about ... inside <answer> </answer> tags.",
     "system_prompt": null, "chat_template_kwargs": {"enable_thinking": false}}

`member_config(model_dir, ...)` is the frozen member config of a model directory with that format applied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlm_corl.config import MemberConfig
from vlm_corl.errors import UserError
from vlm_corl.members.render import PROMPT_STYLES

PROMPT_FORMAT = "prompt_format.json"


def prompt_format(style: str, system_prompt: str | None, chat_template_kwargs: dict | None) -> dict[str, Any]:
    """The file's content for a member asked with `style` (a PROMPT_STYLES key)."""
    return {
        "prompt_style": style,
        "instruction": PROMPT_STYLES[style].format(question="{question}"),  # literal text; replace {question}
        "system_prompt": system_prompt,
        "chat_template_kwargs": chat_template_kwargs,
    }


def read_prompt_format(model_dir: str | Path) -> dict[str, Any] | None:
    """A model directory's prompt_format.json, or None without one; UserError naming the file if unreadable."""
    path = Path(model_dir) / PROMPT_FORMAT
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not readable JSON ({err}); delete it to evaluate with the family's format") from err
    if not isinstance(data, dict) or data.get("prompt_style") not in PROMPT_STYLES:
        raise UserError(f"{path}: prompt_style must be one of {', '.join(PROMPT_STYLES)}")
    return data


def member_config(model_dir: str | Path, name: str | None = None, **fields: Any) -> MemberConfig:
    """A frozen member of `model_dir`, asked in the format its prompt_format.json records (if it has one)."""
    saved = read_prompt_format(model_dir) or {}
    asked = {
        "prompt_style": saved.get("prompt_style"),
        "system_prompt": saved.get("system_prompt"),
        "chat_template_kwargs": saved.get("chat_template_kwargs"),
    }
    return MemberConfig(id=name or Path(model_dir).name, model=str(model_dir), trainable=False, **{**asked, **fields})

"""The one base class of user mistakes: every command prints such an error's message and exits 2, without a
traceback (tracebacks are for our bugs; `--debug` or VLM_CORL_DEBUG=1 shows one anyway)."""

from __future__ import annotations

import os


class UserError(Exception):
    """A mistake in what the user gave (config, data, model files, run directory, launch) that names the
    file or field and what to do."""


class Interrupted(Exception):
    """Ctrl-C during training: one line with the step, the last complete checkpoint and how to resume."""


def debug_requested(argv_flag: bool = False) -> bool:
    """Whether a command should let errors propagate with their traceback."""
    return argv_flag or os.environ.get("VLM_CORL_DEBUG", "").strip().lower() in ("1", "true", "yes")


def brief(err: BaseException) -> str:
    """An exception in one line for a user-facing message: its type and the first line of its text."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__

"""Cohort-atomic checkpoints: all members, optimizers, schedulers, RNG states and the data position, or nothing.

Layout: `RUN/checkpoints/step-N/<member>/` (HF format, loadable by `from_pretrained`, plus the member's
`trainer_state.pt`) and `RUN/checkpoints/step-N/cohort_state.pt`. A checkpoint is written under a temporary
name and renamed when complete, so a process killed at any moment leaves either the previous checkpoints or
the new one, never half of one. (A rename is atomic on POSIX filesystems; a SIGKILL does not drop
written-but-unflushed pages, so no fsync is needed for that failure mode.)
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "cohort_state.pt"
_STEP_DIR = re.compile(r"step-(\d+)")


def rng_states() -> dict:
    """Every RNG a training step may draw from."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def save_checkpoint(run_dir: Path, step: int, members, cohort_state: dict, keep_last: int) -> Path:
    """Write step `step` for every member atomically, then prune to the newest `keep_last` checkpoints."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing
    tmp.mkdir(parents=True)
    for member in members:
        member.save(tmp / member.id)
    torch.save({"step": step, "rng": rng_states(), **cohort_state}, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for d in root.glob("step-*") if root.is_dir() else []:
        m = _STEP_DIR.fullmatch(d.name)
        if m and (d / STATE_FILE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_cohort_state(checkpoint: Path) -> dict:
    """The cohort-level state (step, RNG states, data position, …) of a checkpoint."""
    # weights_only=False: the file holds RNG tuples and numpy state we wrote ourselves.
    return torch.load(Path(checkpoint) / STATE_FILE, weights_only=False)

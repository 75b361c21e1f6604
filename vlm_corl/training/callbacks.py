"""User callbacks of a run (`CohortTrainer(..., callbacks=[...])`): objects with any of the `EVENTS` methods.

They run on world rank 0 only, where the metrics rows are. A callback that raises stops the run cleanly: the
failure is recorded, every rank learns of it at the next agreement point (one small all_gather per step, so no
rank waits forever in a collective), and the run ends with `CallbackFailed` naming the callback, the event and
the step, and the last complete checkpoint, which is left as it was (checkpoints are written atomically).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from vlm_corl.errors import UserError

log = logging.getLogger(__name__)

# on_train_begin(); on_step_end(step, metrics: one row per member); on_evaluate(step, results: eval rows);
# on_save(step, path: the checkpoint directory); on_train_end(summary)
EVENTS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


class CallbackFailed(UserError):
    """A user callback raised; the run stopped after it (the message names it and what was kept)."""


class Callbacks:
    """The run's callbacks and the first failure among them (world rank 0's)."""

    def __init__(self, callbacks: Sequence[object], is_main: bool):
        for cb in callbacks:
            if not any(callable(getattr(cb, event, None)) for event in EVENTS):
                raise TypeError(f"callback {_name(cb)} has none of the methods {', '.join(EVENTS)}")
        self.callbacks, self.is_main, self.failure = list(callbacks), is_main, None

    def fire(self, event: str, step: int, *args) -> None:
        """Call `event` on each callback that has it (rank 0; nothing after a failure); a raise is recorded."""
        if not self.is_main or self.failure is not None:
            return
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if not callable(method):
                continue
            try:
                method(*args)
            except Exception as err:  # noqa: BLE001 - any user error stops the run, named, never a silent crash
                log.exception("callback %s.%s failed at step %d", _name(cb), event, step)
                self.failure = f"callback {_name(cb)}.{event} raised at step {step}: {type(err).__name__}: {err}"
                return

    def agree(self, world, run_dir: Path, latest: Path | None) -> None:
        """Every rank: raise CallbackFailed when rank 0's callbacks failed (an all_gather: call it on all ranks)."""
        if not self.callbacks:  # the same on every rank (each runs the same script): no collective needed
            return
        failure = world.all_gather(self.failure)[0]
        if failure is not None:
            kept = f"the last complete checkpoint, {latest}, is intact" if latest else "no checkpoint was written yet"
            raise CallbackFailed(f"{failure}; the run stopped there ({run_dir}); {kept}")


def _name(cb: object) -> str:
    return getattr(cb, "__name__", None) or type(cb).__name__

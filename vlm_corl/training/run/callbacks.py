"""User callbacks of a run (`CohortTrainer(..., callbacks=...)`): objects with any of the `EVENTS` methods.

They run on world rank 0 only, where the metrics rows are. A callback that raises stops the run cleanly: the
failure is recorded, every rank learns of it at the next agreement point (one small all_gather per step, so no
rank waits forever in a collective), and the run ends with `CallbackFailed` naming the callback, the event and
the step, and the last complete checkpoint, which is left as it was (checkpoints are written atomically).

A callback that wants the run to end early returns (or raises) `StopTraining(reason)`, the counterpart of TRL's
`control.should_training_stop`: every rank learns of it at the same agreement point, and the run ends after that
step as a normal end would (the final checkpoint where `train.save_last` writes one, summary.json naming the
callback in `stopped_by_callback`, `on_train_end`), returning its summary.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable
from pathlib import Path

from vlm_corl.config import ConfigError
from vlm_corl.errors import UserError

log = logging.getLogger(__name__)

# on_train_begin(); on_step_end(step, metrics: one row per member); on_evaluate(step, results: eval rows);
# on_save(step, path: the checkpoint directory); on_train_end(summary)
EVENTS = ("on_train_begin", "on_step_end", "on_evaluate", "on_save", "on_train_end")


class CallbackFailed(UserError):
    """A user callback raised; the run stopped after it (the message names it and what was kept)."""


class StopTraining(Exception):  # noqa: N818 - a request, not an error: named as TRL names the flag
    """Return (or raise) it from a callback method to end the run cleanly after the current step; its text is the
    reason, recorded in summary.json. From `on_train_begin` (or the step-0 evaluation's `on_evaluate`) no step
    runs; from `on_train_end` it changes nothing (the run has ended)."""


class Callbacks:
    """The run's callbacks, the first failure among them and the first stop asked for (world rank 0's)."""

    def __init__(self, callbacks: object, is_main: bool):
        self.callbacks, self.is_main = callback_list(callbacks), is_main
        self.failure: str | None = None
        self.stop: dict | None = None  # {callback, event, step, reason} of the first StopTraining

    def fire(self, event: str, step: int, *args) -> None:
        """Call `event` on each callback that has it (rank 0; nothing after a failure); a raise is recorded, and
        so is the first `StopTraining` returned or raised (the other callbacks still see the event)."""
        if not self.is_main or self.failure is not None:
            return
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if not callable(method):
                continue
            try:
                result = method(*args)
            except StopTraining as stop:
                result = stop
            except Exception as err:  # noqa: BLE001 - any user error stops the run, named, never a silent crash
                log.exception("callback %s.%s failed at step %d", _name(cb), event, step)
                self.failure = f"callback {_name(cb)}.{event} raised at step {step}: {type(err).__name__}: {err}"
                return
            if isinstance(result, StopTraining) and self.stop is None and event != "on_train_end":
                reason = str(result) or None
                self.stop = {"callback": _name(cb), "event": event, "step": step, "reason": reason}
                log.info("callback %s.%s asked the run to stop at step %d: %s", _name(cb), event, step, reason)

    def agree(self, world, run_dir: Path, latest: Path | None) -> dict | None:
        """Every rank: raise CallbackFailed when rank 0's callbacks failed, else return the stop they asked for
        (`self.stop` of rank 0, or None); an all_gather: call it on all ranks."""
        if not self.callbacks:  # the same on every rank (each runs the same script): no collective needed
            return None
        failure, stop = world.all_gather((self.failure, self.stop))[0]
        if failure is not None:
            kept = f"the last complete checkpoint, {latest}, is intact" if latest else "no checkpoint was written yet"
            raise CallbackFailed(f"{failure}; the run stopped there ({run_dir}); {kept}")
        return stop


def callback_list(callbacks: object) -> list:
    """`callbacks` as a list: None (none), one callback object, or a list of them; a ConfigError naming each one
    that is not a callback: a class (not an instance), an object with none of the `EVENTS` methods, or a method
    named like an event but misspelt (it would never be called)."""
    if callbacks is None:
        return []
    single = isinstance(callbacks, (str, bytes, type)) or not isinstance(callbacks, Iterable)
    if single or any(callable(getattr(callbacks, event, None)) for event in EVENTS):
        given = [("callbacks", callbacks)]
    else:
        given = [(f"callbacks[{i}]", cb) for i, cb in enumerate(callbacks)]
    problems = [(path, problem) for path, cb in given if (problem := _callback_problem(cb))]
    if problems:
        raise ConfigError([f"{path}: {problem}" for path, problem in problems], [path for path, _ in problems])
    return [cb for _, cb in given]


def _callback_problem(cb: object) -> str | None:
    if isinstance(cb, type):
        return f"{cb.__name__} is a class; pass an instance, {cb.__name__}()"
    shown = repr(cb) if isinstance(cb, (str, bytes, int, float)) else _name(cb)
    if not any(callable(getattr(cb, event, None)) for event in EVENTS):
        return f"{shown} has none of the methods {', '.join(EVENTS)}"
    for attr in dir(cb):
        if attr.startswith("on_") and attr not in EVENTS and callable(getattr(cb, attr, None)):
            close = difflib.get_close_matches(attr, EVENTS, n=1, cutoff=0.8)
            if close:
                return f"{shown}.{attr} is no event, so it would never be called: did you mean {close[0]}?"
    return None


def _name(cb: object) -> str:
    return getattr(cb, "__name__", None) or type(cb).__name__

"""`corl preflight`'s time limit and its agreement after a failure, so that a hang or one rank's failure ends in a
verdict on every rank instead of a launcher's kill.

- Time limit (`--timeout`, PREFLIGHT_TIMEOUT_S): the process groups' collectives fail after it (not the run's
  train.dist_timeout_s), and on CUDA NCCL's blocking wait makes such a timeout raise in Python (torch's default,
  async error handling 3, tears the process down with no exception and so no report).
- Agreement through the launch's key-value store (the one `World.report` writes to), never a collective: a rank
  that fails publishes its `Failure` there (the first published is the verdict), and at each phase's end a rank
  marks its arrival and waits until every rank has arrived or a verdict is there.
- Watchdog: one thread per rank with each phase's deadline. When a verdict appears while this rank's main thread
  is still inside a collective the failed rank will never join, or when the deadline passes, it ends the rank
  itself: the verdict (a hang: this phase, this rank or the ranks that never arrived, its threads' tracebacks)
  written as the report would be, then the process exits with the verdict's status.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # `corl preflight --help` imports this module for its default: no torch at import
    from vlm_corl.distributed.world import World

log = logging.getLogger("vlm_corl")

PREFLIGHT_TIMEOUT_S = 300.0  # a phase's deadline and the collectives' timeout (`corl preflight --timeout`)
LOAD_FACTOR = 3  # the load phase builds the engines (vLLM's compile and graph capture): three deadlines
POLL_S = 0.1  # how often a waiting rank reads the store
GRACE_S = 3.0  # how long a rank's main thread has to take a published verdict itself before its watchdog does
KEY = "vlm_corl/preflight"
WORKS, WAITS, SILENT = "is busy outside any collective", "waits in a collective", "never answered (died?)"
HANG_FIX = (
    "a collective or a step that never finished: the traceback of each thread is in preflight.json (watchdog); "
    "rerun with NCCL_DEBUG=INFO, check the node's GPUs and network (nvidia-smi topo -m), and report it with "
    "preflight.json"
)


@dataclass
class Failure:
    """The first thing that went wrong: where (phase, rank, member), what, the fix to try, and the exit status
    (2: the user's to fix, such as the config, the memory plan, the disk; 3: measured, such as a push that does
    not reach the engine, a hang, or a fault of the install)."""

    phase: str
    rank: int
    member: str | None
    error: str
    fix: str
    exit_status: int


class PreflightFailed(Exception):
    """Every rank stops at the same phase with the same `Failure` (the first one published)."""

    def __init__(self, failure: Failure):
        super().__init__(f"{failure.phase}: {failure.error}")
        self.failure = failure


def nccl_environment(device_type: str) -> dict[str, str]:
    """What preflight sets in the environment before its process group is made: on CUDA NCCL's blocking wait (a
    collective past the timeout raises DistBackendError in the waiting thread); nothing for gloo, which raises on
    its own."""
    return {"TORCH_NCCL_BLOCKING_WAIT": "1"} if device_type == "cuda" else {}


def phase_deadline(phase: str, timeout_s: float) -> float:
    """Seconds phase `phase` may take before the watchdog ends the rank."""
    return timeout_s * (LOAD_FACTOR if phase == "load" else 1)


class Agreement:
    """The verdict and the phases' arrivals in the launch's store; in one process (no store) this rank's own
    failure is the verdict."""

    def __init__(self, world: World):
        self.world = world
        self.store = world.kv_store()
        # torchrun's store outlives a restart of the workers: each attempt agrees under its own keys
        self.key = f"{KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def publish(self, failure: Failure) -> Failure:
        """Offer `failure` as the verdict; returns the verdict (an earlier rank's failure, if one was first)."""
        if self.store is None:
            return failure
        return Failure(**json.loads(self.store.compare_set(f"{self.key}/verdict", "", json.dumps(asdict(failure)))))

    def verdict(self) -> Failure | None:
        """The published verdict, if any."""
        if self.store is None or not self.store.check([f"{self.key}/verdict"]):
            return None
        return Failure(**json.loads(self.store.get(f"{self.key}/verdict")))

    def missing(self, phase: str) -> list[int]:
        """The ranks that have not yet finished `phase`."""
        if self.store is None:
            return []
        return [r for r in range(self.world.size) if not self.store.check([f"{self.key}/arrived/{phase}/{r}"])]

    def arrive(self, phase: str, failure: Failure | None) -> Failure | None:
        """This rank's end of `phase` (its failure published first): waits until every rank has arrived or a
        verdict is published, and returns the verdict (None: every rank got through). No deadline of its own:
        the watchdog's covers it."""
        if self.store is None:  # one process, or a torch without the store: a collective, as before
            failed = [f for f in self.world.all_gather(failure) if f is not None]
            return failed[0] if failed else None
        if failure is not None:
            self.publish(failure)
        self.store.set(f"{self.key}/arrived/{phase}/{self.world.rank}", "1")
        while True:
            verdict = self.verdict()
            if verdict is not None:
                return verdict
            if not self.missing(phase):  # every rank published its failure, if any, before it arrived
                return self.verdict()
            time.sleep(POLL_S)

    def share(self, name: str, value: object) -> None:
        """Publish this rank's `value` (JSON) under `name`."""
        if self.store is not None:
            self.store.set(f"{self.key}/{name}/{self.world.rank}", json.dumps(value, default=str))

    def collect(self, name: str, own: object, wait_s: float) -> dict[int, object]:
        """{rank: value} of every rank's `share(name, ...)` found within `wait_s` (this rank's `own` always;
        what was found when the store's host, world rank 0's process or the launcher's agent, went away)."""
        if self.store is None:
            return {self.world.rank: own}
        found, deadline = {self.world.rank: own}, time.monotonic() + wait_s
        try:
            while len(found) < self.world.size and time.monotonic() < deadline:
                for r in range(self.world.size):
                    if r not in found and self.store.check([f"{self.key}/{name}/{r}"]):
                        found[r] = json.loads(self.store.get(f"{self.key}/{name}/{r}"))
                time.sleep(0 if len(found) == self.world.size else POLL_S)
        except (RuntimeError, OSError):
            pass
        return found


def culprit(states: dict[int, str]) -> int:
    """The rank a hang is blamed on, from each unfinished rank's state: the first that works (a rank waiting in
    a collective waits for it), else the first that never answered, else the first."""
    for wanted in (WORKS, SILENT):
        found = sorted(r for r, state in states.items() if state == wanted)
        if found:
            return found[0]
    return min(states)


def main_in_collective() -> bool:
    """Whether the main thread is inside a torch.distributed call (one of its three innermost Python frames)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    for _ in range(3):
        if frame is None:
            return False
        if f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def thread_stacks() -> str:
    """Every thread's Python stack (faulthandler's: it also reads a thread blocked in C code, such as a
    collective)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


class Watchdog:
    """This rank's deadline keeper: `arm(phase, member)` at a phase's start, `disarm()` when the phase is agreed.
    It ends the rank through `stop(failure, stacks)` (which writes the verdict and exits) when a published verdict
    is not taken by the main thread within GRACE_S, or when the phase's deadline passes. `lock` is the rank's
    ending: whoever holds it writes the verdict."""

    def __init__(self, agreement: Agreement, timeout_s: float, stop: Callable[[Failure, str | None], None]):
        self.agreement, self.timeout_s, self.stop = agreement, timeout_s, stop
        self.lock = threading.Lock()
        self._armed: tuple[str, str | None, float] | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="preflight-watchdog", daemon=True)
        self._thread.start()

    def arm(self, phase: str, member: str | None) -> None:
        self._armed = (phase, member, time.monotonic() + phase_deadline(phase, self.timeout_s))

    def disarm(self) -> None:
        self._armed = None

    def close(self) -> None:
        """Stop the thread (the preflight has ended)."""
        self._closed.set()
        self._thread.join()

    def _watch(self) -> None:
        seen = None  # when this thread first saw a verdict the main thread has not taken
        while not self._closed.wait(POLL_S):
            armed = self._armed
            if armed is None:
                seen = None
                continue
            try:
                verdict = self.agreement.verdict()
            except (RuntimeError, OSError):  # the store's host is gone: only the deadline is left to act on
                verdict = None
            now = time.monotonic()
            if verdict is not None:
                seen = now if seen is None else seen
                if now - seen > GRACE_S:
                    self._end(verdict, thread_stacks())
            elif now > armed[2]:
                stacks = thread_stacks()
                self._end(self._hang(armed[0], armed[1]), stacks)

    def _hang(self, phase: str, member: str | None) -> Failure:
        """The verdict of a passed deadline (the first failure published stays the verdict): each rank still in
        the phase says whether its main thread waits in a collective; the rank named is the first one still
        working (not in a collective: it hangs on its own), else the first silent one (died), else the first."""
        agreement, rank = self.agreement, self.agreement.world.rank
        seconds = phase_deadline(phase, self.timeout_s)
        own = [WAITS if main_in_collective() else WORKS, member]
        try:
            agreement.share(f"deadline/{phase}", own)
            found = agreement.collect(f"deadline/{phase}", own, GRACE_S)
            missing = agreement.missing(phase)
        except (RuntimeError, OSError):  # the store's host is gone: this rank speaks for itself
            found, missing = {rank: own}, [rank]
        found = {r: found.get(r) or [SILENT, None] for r in missing}
        named = culprit({r: state for r, (state, _) in found.items()})
        error = (
            f"the {phase} phase did not finish within {seconds:g} s (the preflight's time limit, --timeout): "
            + "; ".join(f"rank {r} {state}" for r, (state, _) in sorted(found.items()))
        )
        failure = Failure(phase, named, found[named][1], error, HANG_FIX, 3)
        try:
            return agreement.publish(failure)
        except (RuntimeError, OSError):
            return failure

    def _end(self, failure: Failure, stacks: str) -> None:
        if not self.lock.acquire(blocking=False):  # the main thread is already ending the rank
            return
        log.error("preflight: rank %d stops at %s: %s", self.agreement.world.rank, failure.phase, failure.error)
        self.stop(failure, stacks)
        os._exit(failure.exit_status)

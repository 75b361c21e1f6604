"""Checkpoints written in the background (`train.async_checkpoint`): the step pays for the host copy only.

At the step every rank takes host copies of what it writes (`Member.snapshot`: weights, optimizer, schedule;
pinned memory on CUDA) and its RNG states, then one background thread per process writes the member
directories into `checkpoints/.tmp-step-N/` while training goes on. The checkpoint becomes complete (cohort
state, manifest, rename: `checkpoint.finish_checkpoint`, the marker a resume reads) only once every rank's
files are on disk, and only then are old ones pruned. Every rank learns that at the same point of the loop:
`poll` at each step's end (one small collective while a write is pending), `wait` before the next checkpoint,
at the run's end and before a rollback; so a process killed during the write leaves the previous checkpoint as
the latest, and `.tmp-step-N` is removed by the next save. The background thread runs no collective: a process
group is driven by the main thread alone.

A DeepSpeed member's engine writes its own state (`Member.save`): with one in the cohort, checkpoints are
written at the step as before (`config.schema.resolve_async`, which the memory planner reads too).
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_corl.training.run.checkpoint import _disk_full_is_named, finish_checkpoint, rng_states

if TYPE_CHECKING:
    from vlm_corl.distributed.world import World
    from vlm_corl.members.member import Member

log = logging.getLogger("vlm_corl")


@dataclass
class _Pending:
    """One checkpoint being written: its step, cohort state (RNG states included), and the writer's outcome."""

    step: int
    state: dict
    tmp: Path
    thread: threading.Thread | None = None
    error: BaseException | None = None
    writes: list[tuple[Path, Callable[[Path], None]]] = field(default_factory=list)

    def run(self) -> None:
        try:
            for directory, write in self.writes:
                write(directory)
        except BaseException as err:  # noqa: BLE001 - carried to the main thread, raised there at `wait`
            self.error = err
        self.writes = []  # the host copies go as soon as they are on disk


class BackgroundCheckpoints:
    """A run's checkpoints written off the step's critical path: `save` at the step, `poll` at every step's end,
    `wait` before anything that reads or prunes checkpoints. At most one write is pending."""

    def __init__(self, world: World, run_dir: Path, keep_last: int):
        self.world, self.run_dir, self.keep_last = world, Path(run_dir), keep_last
        self.pending: _Pending | None = None

    def save(self, step: int, models: Iterable[tuple[Member, bool]], cohort_state: dict) -> None:
        """Take step `step`'s host copies now and start writing them (every rank, at the same step); the
        previous checkpoint is completed first."""
        self.wait()
        tmp = self.run_dir / "checkpoints" / f".tmp-step-{step}"
        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing
            tmp.mkdir(parents=True)
        self.world.barrier()
        rngs = self.world.all_gather(rng_states())  # every rank's RNG states, in rank order
        pending = _Pending(step, {"rng": rngs, **cohort_state}, tmp)
        pending.writes = [(tmp / member.id, member.snapshot(write=writes)) for member, writes in models]
        pending.thread = threading.Thread(target=pending.run, name=f"checkpoint-{step}", daemon=True)
        pending.thread.start()
        self.pending = pending

    def poll(self) -> Path | None:
        """Complete the pending checkpoint if every rank has written its files (every rank calls this at the
        same point); its path, or None while a write goes on or none is pending."""
        if self.pending is None:
            return None
        done = self.world.all_gather(not self.pending.thread.is_alive())
        return self.wait() if all(done) else None

    def wait(self) -> Path | None:
        """Wait for the pending write and make it a complete checkpoint (every rank); its path, or None when
        none was pending. A failed write (a full disk: `DiskFull`) is raised on every rank, the partial
        directory removed: the previous checkpoint stays the latest."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.thread.join()
        error = pending.error
        errors = self.world.all_gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            with _disk_full_is_named(pending.tmp, pending.step, self.run_dir):
                if pending.error is not None:
                    raise pending.error
                if self.world.is_main:
                    shutil.rmtree(pending.tmp, ignore_errors=True)
                rank, err = failed[0]
                raise RuntimeError(f"rank {rank} failed writing checkpoint step {pending.step}: {err}")
        return finish_checkpoint(self.world, self.run_dir, pending.step, pending.state, self.keep_last)

    def written(self) -> None:
        """Wait, on this process only, until the pending write's files are on disk (no collective: the checkpoint
        is still completed at `poll` or `wait`). `keep_best` calls it before saving: the writer thread saves the
        same modules, and two writes of one member never overlap (nor add up their host copies)."""
        if self.pending is not None:
            self.pending.thread.join()

    def abandon(self) -> None:
        """On a failure: let this process's write finish. A single process completes the checkpoint (it was
        taken at a step's end, whole); several leave it incomplete, the previous one the latest, since the other
        ranks may be gone and completing needs them all."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        pending.thread.join()
        if self.world.distributed or pending.error is not None:
            return
        try:
            finish_checkpoint(self.world, self.run_dir, pending.step, pending.state, self.keep_last)
        except Exception as err:  # noqa: BLE001 - the run's own failure is the one raised
            log.warning("checkpoint step %d was not completed (%s): the previous one is the latest", pending.step, err)

"""What a run gives back when it ends, whether it returned or raised: nothing it built stays reachable (members,
optimizers, DeepSpeed and rollout engines, EMA teachers, renderers and their prompt caches, trackers, the
process groups it created), so a second run in the same process starts from the memory the first one found.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vlm_corl.distributed.world import CollectiveError
from vlm_corl.members.deepspeed_update import open_engines
from vlm_corl.members.engines import release_engines

if TYPE_CHECKING:
    from vlm_corl.training.run.setup import CohortRun


def release_run(run: CohortRun) -> None:
    """Give back what `start_run` built: the trackers finished (a run that raised has no summary to give them),
    the vLLM engines closed (`close_vllm_engines`), the members' process groups destroyed (not after failed
    collectives: `collectives_failed`, read from the exception the caller's `finally` is raising), and the
    members, slots (engines, renderers, EMA teachers) and groups let go, so that whoever still holds `run` holds
    an empty shell."""
    if run.sink is not None:
        run.sink.close()
    close_vllm_engines()
    if dist.is_initialized() and not collectives_failed(sys.exc_info()[1]):
        for group in [*run.world.groups.values(), *run.world.singles.values()]:
            dist.destroy_process_group(group)
    run.members, run.slots, run.world.groups, run.world.singles = [], [], {}, {}


def close_vllm_engines() -> None:
    """Shut the process's vLLM engines down (when vLLM's engine module was loaded) before anything else is given
    back: collected instead, each would tear the process groups down (`vllm.close_engines`)."""
    engines = sys.modules.get("vlm_corl.members.engines.vllm")
    if engines is not None:
        engines.close_engines()


def collectives_failed(err: BaseException | None) -> bool:
    """Did the run end because another rank died or hung (a CollectiveError, or the RankFailure raised from
    one)? Then no process group is torn down: NCCL's teardown of a group with a collective that never completed
    may wait for it, so the groups are left to the process's exit, which follows."""
    return err is not None and any(isinstance(e, CollectiveError) for e in (err, err.__cause__))


@contextmanager
def giving_back() -> Iterator[None]:
    """Around a whole run (`run_cohort`, inside which `release_run` has let go of the run): on the way out the
    DeepSpeed engines opened meanwhile are closed (a start that failed halfway never made a run to release), the
    default process group destroyed if the run created it (vLLM's groups first; one that existed before, the
    user's or accelerate's, is left alone; one whose collectives failed is left to the process's exit), dynamo's
    caches reset (on CUDA the cudagraph trees' pool would outlive the run), the cyclic garbage collected, and
    on CUDA the allocator's cache handed back. An exception leaves with the open vLLM engines closed first and
    the locals of its finished frames cleared (`forget_locals`)."""
    created, opened, broken = not dist.is_initialized(), set(open_engines()), False
    try:
        yield
    except BaseException as err:
        close_vllm_engines()  # a failed start's engines: the frames cleared next may be the last to hold them
        forget_locals(err)
        broken = collectives_failed(err)
        raise
    finally:
        with launcher_stop_ignored():
            _close_deepspeed(set(open_engines()) - opened)  # in its own frame: no engine left in a local here
            if created and dist.is_initialized() and not broken:
                release_engines()  # vLLM's groups first (its teardown destroys the default group too)
                if dist.is_initialized():
                    dist.destroy_process_group()
            if "torch._dynamo" in sys.modules:  # something was compiled (the HF engine's static decode steps)
                torch._dynamo.reset()  # its caches, and on CUDA the cudagraph trees' private memory pool
            # vLLM's engine freezes the heap when it is built (gc.freeze): a start that failed after one engine
            # froze it, before `start_run` unfroze it, would leave that run's objects out of the collector's reach.
            gc.unfreeze()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


@contextmanager
def launcher_stop_ignored() -> Iterator[None]:
    """While a rank of a launched run gives back what it took: the launcher's SIGTERM, sent to every rank once one
    has ended (all ranks of a numerical stop end alike, one a little sooner), is ignored, so that this rank
    finishes its release and reports its own outcome (exit code and message) instead of dying half-way; the
    launcher kills a rank that outstays its grace period anyway."""
    if not dist.is_initialized() or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _close_deepspeed(engines: set) -> None:
    for engine in engines:
        engine.close()


def forget_locals(err: BaseException) -> None:
    """Clear the local variables of every finished frame in the tracebacks of `err` and of the exceptions it
    chains (cause and context): a caller that keeps the exception (a notebook, `pytest.raises`, a retry loop)
    would otherwise keep every model, optimizer and activation those frames held. The traceback still prints
    (files, lines, code); only a post-mortem debugger loses the locals."""
    pending, seen = [err], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]

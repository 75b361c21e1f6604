"""The cohort training loop: each step one short row of named, timed phases, each phase's work in its room.

sample → render → rollout → extract → exchange → reward (→ resample) → advantage → update → sync → log
→ checkpoint → eval, then the guards. The rooms: render_ahead.py (render), rollout_phase.py (rollout, extract),
distributed/exchange.py, reward_phase.py (reward, resample), grpo.py (advantage), update_phase.py (update,
sync), step_metrics.py (log), checkpoint_phase.py, eval_phase.py; setup.py builds the run, release.py gives it
back, summary.py ends it.
"""

from __future__ import annotations

import collections.abc
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

from vlm_corl.config import CohortConfig
from vlm_corl.config.schema import TrainConfig
from vlm_corl.distributed.exchange import exchange
from vlm_corl.distributed.world import CollectiveError, World, failure_report
from vlm_corl.errors import Interrupted
from vlm_corl.members.finite import NonFiniteLogits
from vlm_corl.training.monitor.throughput import start_throughput
from vlm_corl.training.phases.checkpoint_phase import checkpoint_phase
from vlm_corl.training.phases.eval_phase import eval_phase
from vlm_corl.training.phases.phase_timer import PhaseTimer
from vlm_corl.training.phases.progress import Progress
from vlm_corl.training.phases.render_ahead import RenderAhead
from vlm_corl.training.phases.reward_phase import cohort_batch, resample_phase, reward_phase
from vlm_corl.training.phases.rollout_phase import extract_phase, rollout_phase
from vlm_corl.training.phases.step_metrics import StepResult, log_phase
from vlm_corl.training.phases.update_phase import follow_students, sync_phase, update_phase
from vlm_corl.training.rewards.dynamic_sampling import StepRollouts
from vlm_corl.training.rewards.grpo import group_advantages
from vlm_corl.training.rewards.reward_funcs import RewardFunction, run_reward_functions
from vlm_corl.training.run.callbacks import Callbacks
from vlm_corl.training.run.checkpoint import latest_checkpoint
from vlm_corl.training.run.guard import CollapseStopped, roll_back, stop_message
from vlm_corl.training.run.numerics import NonFiniteStopped
from vlm_corl.training.run.release import giving_back, launcher_stop_ignored, release_run
from vlm_corl.training.run.setup import CohortRun, start_run
from vlm_corl.training.run.summary import finish_run


class RankFailure(RuntimeError):
    """Another rank died or hung: this rank stops with a report of where every rank was (no traceback)."""


def run_cohort(
    cfg: CohortConfig,
    callbacks: collections.abc.Sequence[object] = (),
    reward_funcs: collections.abc.Sequence[RewardFunction] | None = None,
) -> dict:
    """Train the cohort described by `cfg`; returns the summary also written to summary.json (by rank 0).
    `callbacks`: objects with any of `callbacks.EVENTS`, called on world rank 0; `reward_funcs`: the reward
    functions added to the mode's reward (`CohortTrainer`'s, `run_reward_functions`; None: reward.custom's).
    Returned or raised, nothing the run built stays reachable (`vlm_corl.training.run.release`)."""
    if reward_funcs is None:
        reward_funcs = run_reward_functions(cfg)
    if not sys.stderr.isatty():  # a log file: no carriage-return frames of the libraries' loading/saving bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    with giving_back():  # returned or raised, the run's memory and the process group it made go back
        return _train_and_release(cfg, callbacks, reward_funcs)


def _train_and_release(
    cfg: CohortConfig, callbacks: collections.abc.Sequence[object], reward_funcs: list[RewardFunction]
) -> dict:
    """`run_cohort`'s run from its start to its release (`release_run`), whether it returns or raises."""
    run = start_run(cfg, reward_funcs)
    timer, renders = PhaseTimer(run.world, run.start), RenderAhead(run)
    try:
        run.callbacks = Callbacks(callbacks, run.world.is_main)
        run.reward_funcs = list(reward_funcs)
        with stopped_by_launcher(run.world):
            return train_steps(run, timer, renders)
    except KeyboardInterrupt:
        last = latest_checkpoint(run.run_dir)
        resume = f"resume from {last} with train.resume=true" if last else "no checkpoint was written yet"
        raise Interrupted(f"interrupted at step {timer.step + 1} ({timer.phase}); {resume}") from None
    except NonFiniteLogits as err:  # a numerical fault in a rollout: named, with what is kept
        last = latest_checkpoint(run.run_dir)
        kept = f"the last complete checkpoint is {last}" if last else "no checkpoint was written yet"
        raise NonFiniteStopped(f"numerical guard: step {timer.step + 1} ({timer.phase}): {err}; {kept}") from None
    except CollectiveError as err:
        if run.world.distributed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop may not cut the report short
        raise RankFailure(
            failure_report(run.world, run.placement, err, timer.step + 1, timer.phase, latest_checkpoint(run.run_dir))
        ) from err
    finally:
        with launcher_stop_ignored():
            renders.close()  # a raise mid-step leaves the next batch rendering in the background
            if run.checkpoints is not None:
                run.checkpoints.abandon()  # a failure: the write in flight ends (completed by a lone process)
            if run.throughput is not None:
                run.throughput.close()  # the GPU busy sampler's nvidia-smi
            release_run(run)


@contextmanager
def stopped_by_launcher(world: World) -> Iterator[None]:
    """When one worker dies, torchrun/accelerate stop the others with SIGTERM: turn it into a CollectiveError
    so that this rank, too, reports where every rank was before it exits."""
    if not world.distributed or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> NoReturn:
        raise CollectiveError("stopped by the launcher (SIGTERM): another process of the job failed")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_steps(run: CohortRun, timer: PhaseTimer, renders: RenderAhead) -> dict:
    """The step loop from `run.start` to train.max_steps; `timer` is renewed each step (phases and times),
    `renders` renders each step's batch (and the next one in the background)."""
    progress, stopped = Progress(run), None
    stop = begin_phase(run, timer)
    teachers = {spec.id for spec in run.specs if spec.teacher}
    run.throughput = start_throughput(run.world, run.cfg, run.specs, lambda: timer.phase)  # metrics rows: speed
    for step in progress:
        if stop is not None:  # asked for before the first step: none runs
            break
        step_start = time.perf_counter()
        timer.start_step(step)
        rows, warnings = step_phases(run, step, timer, renders)
        progress.show(step, [r for r in rows if r["member"] not in teachers])  # an EMA teacher earns no reward
        warnings += after_step(run, step + 1, timer, rows, step_start)
        stop = run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
        run.nonfinite.observe(step + 1, run.updates, latest_checkpoint(run.run_dir), run.world.is_main)
        stopped = guard_phase(run, warnings, step + 1)
        if stopped is not None:
            break
        if stop is not None:  # a callback's clean stop: the run ends here as at train.max_steps, checkpoint included
            if run.cfg.train.save_last and not save_due(run.cfg.train, step + 1):
                save_step(run, step + 1, rows, timer)
            break
    return end_phase(run, renders, stopped, stop)


def step_phases(run: CohortRun, step: int, timer: PhaseTimer, renders: RenderAhead) -> tuple[list, list]:
    """One step from sampling to the log phase (0-based `step`): world rank 0's metrics rows and the collapse
    warnings they raised (empty on the other ranks)."""
    cfg = run.cfg
    with timer("sample"):
        indices = run.sampler.next_batch()
    with timer("render"):
        batch, prompts = renders.prompts(indices, step)
    with timer("rollout"):
        groups, rollout_s = rollout_phase(run, prompts, step)
    with timer("extract"):
        local = extract_phase(run, groups, batch)
    with timer("exchange"):
        exchanged = exchange(run.world, [ex.id for ex in batch], local, [s.id for s in run.specs])
    with timer("reward"):
        cohort, scored = reward_phase(run, batch, exchanged, step)
    rolled, resampled = StepRollouts(renders.indices, batch, groups, exchanged, scored, rollout_s), {}
    if cfg.algo.resample_zero_variance:
        with timer("resample"):
            rolled, resampled = resample_phase(run, renders, step, rolled)
            cohort = cohort_batch(run, rolled.batch, rolled.exchanged)
    with timer("advantage"):
        rewards = rolled.scored.rewards
        advantages = [group_advantages(r, cfg.algo.scale_rewards, cfg.algo.adv_eps) for r in rewards]
    with timer("update"):
        updates = update_phase(run, rolled.groups, advantages, rewards, rolled.exchanged[3], rolled.exchanged[6])
        follow_students(run, step)
    with timer("sync"):
        sync_phase(run)
    with timer("log"):
        return log_phase(run, timer, StepResult(step + 1, rolled, cohort, advantages, updates, resampled))


def begin_phase(run: CohortRun, timer: PhaseTimer) -> dict | None:
    """Before the first step: the callbacks' on_train_begin, and on a fresh run with eval.every the step-0
    evaluation (the eval-drop flag's baseline, the first best model). A callback's StopTraining, or None."""
    run.callbacks.fire("on_train_begin", run.start)
    stop = run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
    if run.cfg.eval.every and run.start == 0 and stop is None:
        with timer("eval"):
            eval_phase(run, 0)
        stop = run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
    return stop


def after_step(run: CohortRun, done: int, timer: PhaseTimer, rows: list[dict], step_start: float) -> list[dict]:
    """After step `done` (1-based): its checkpoint when due, its evaluation when due, its metrics rows written
    with the phases' times, on_step_end; returns the evaluation's collapse warnings."""
    cfg, warnings = run.cfg, []
    if save_due(cfg.train, done):
        save_step(run, done, rows, timer)
    if cfg.eval.every and done % cfg.eval.every == 0:
        with timer("eval"):
            warnings = eval_phase(run, done)
    if done % cfg.logging.log_every == 0 and run.sink is not None:
        times = {f"time_{k}": v for k, v in timer.seconds.items()}
        times["time_step"] = time.perf_counter() - step_start  # everything but this write
        run.sink.write(run.throughput.fields([{**row, **times} for row in rows]))
    run.callbacks.fire("on_step_end", done, done, rows)
    if run.checkpoints is not None:
        run.checkpoints.poll()  # a background write done on every rank: the checkpoint is complete
    return warnings


def save_step(run: CohortRun, done: int, rows: list[dict], timer: PhaseTimer) -> None:
    """The checkpoint phase after step `done` (1-based), then the callbacks' on_save."""
    with timer("checkpoint"):
        checkpoint_phase(run, done, rows)
    run.callbacks.fire("on_save", done, done, latest_checkpoint(run.run_dir))


def end_phase(run: CohortRun, renders: RenderAhead, stopped: dict | None, stop: dict | None) -> dict:
    """The run's end: the background render and checkpoint finished, summary.json, on_train_end; a collapse
    guard's stop (`stopped`) raised once every rank has its summary."""
    renders.close()
    if run.checkpoints is not None:
        run.checkpoints.wait()  # the last checkpoint is complete before the run reports it
    summary = finish_run(run, stopped, stop)
    run.callbacks.fire("on_train_end", run.cfg.train.max_steps if stop is None else stop["step"], summary)
    run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
    if stopped is not None:
        raise CollapseStopped(stopped["message"])
    return summary


def save_due(train: TrainConfig, step: int) -> bool:
    """Does the loop write a checkpoint after `step` (1-based)? Every train.save_every steps, and at the last
    step unless train.save_last is off."""
    return bool(train.save_every and step % train.save_every == 0) or (train.save_last and step == train.max_steps)


def guard_phase(run: CohortRun, warnings: list[dict], done: int) -> dict | None:
    """`train.on_collapse` on the new warnings of step `done` (1-based; world rank 0 holds them): None to go on,
    or, after a rollback where asked for, {action, warning, message, step: `done`} (every rank stops)."""
    action = run.cfg.train.on_collapse
    if action == "warn":
        return None
    # the most specific evidence names the stop: a category's flag before the batch's of the same step
    named = next((w for w in warnings if w.get("category") is not None), warnings[0]) if warnings else None
    first = run.world.all_gather(named)[0]
    if first is None:
        return None
    if run.checkpoints is not None:
        run.checkpoints.wait()  # a rollback or a stop names (and prunes) complete checkpoints only
    checkpoint = None
    if run.world.is_main:
        checkpoint = roll_back(run.run_dir, first["step"]) if action == "rollback" else latest_checkpoint(run.run_dir)
    run.world.barrier()  # the checkpoints are where the message says before any rank exits
    return {"action": action, "warning": first, "message": stop_message(first, action, checkpoint), "step": done}

"""The cohort training loop: one short function of named, timed phases.

sample → render → rollout → extract → exchange → reward → advantage → update → log → checkpoint → eval
"""

from __future__ import annotations

import collections.abc
import logging
import math
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import NoReturn

import torch
from tqdm import tqdm

from vlm_corl.config import CohortConfig
from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.loading import config_to_dict
from vlm_corl.config.schema import EvalConfig, TrainConfig
from vlm_corl.data.answers import extract_answer
from vlm_corl.data.records import Example
from vlm_corl.distributed.exchange import exchange
from vlm_corl.distributed.world import (
    CollectiveError,
    World,
    failure_report,
    shard,
    weights_checksum,
)
from vlm_corl.errors import Interrupted
from vlm_corl.evaluation.scoring import benchmark_examples, sample_records, score_records
from vlm_corl.members.deepspeed_update import state_files
from vlm_corl.members.finite import NonFiniteLogits
from vlm_corl.members.render import PromptTooLong
from vlm_corl.members.rollout import Prompt, RolloutGroup, SamplingParams
from vlm_corl.members.update import Sequence, policy_update, response_token_stats
from vlm_corl.planning.check import against_plan
from vlm_corl.registry import BENCHMARKS
from vlm_corl.training.callbacks import Callbacks
from vlm_corl.training.category_metrics import category_step_stats, window_metrics
from vlm_corl.training.checkpoint import (
    latest_checkpoint,
    required_files,
    save_checkpoint,
)
from vlm_corl.training.collapse import describe as describe_collapse
from vlm_corl.training.collapse import eval_drops
from vlm_corl.training.dynamic_sampling import StepRollouts, resample, sub_shards
from vlm_corl.training.grpo import group_advantages, nonzero_variance_groups
from vlm_corl.training.guard import (
    CollapseStopped,
    improved,
    roll_back,
    save_best,
    stop_message,
    write_best,
)
from vlm_corl.training.metrics import cohort_unanimity, member_metrics, pairwise_agreement, unanimity
from vlm_corl.training.numerics import NonFiniteStopped, check_rollout_mismatch
from vlm_corl.training.release import giving_back, launcher_stop_ignored, release_run
from vlm_corl.training.reward_funcs import (
    RewardFunction,
    add_function_rewards,
    function_name,
    function_rewards,
    run_reward_functions,
)
from vlm_corl.training.rewards import CohortBatch, RewardOutput, add_overlong_penalty
from vlm_corl.training.samples import SampleSettings, sample_rows, samples_due
from vlm_corl.training.setup import CohortRun, start_run
from vlm_corl.training.slots import (
    Slot,
    ema_update,
    models_to_save,
    teacher_decay,
)
from vlm_corl.training.summary import finish_run
from vlm_corl.training.throughput import start_throughput

log = logging.getLogger("vlm_corl")

FORMAT_PATTERNS = {"boxed": "\\boxed{", "answer_tags": "<answer>"}
# the update stats each member's metrics row carries (members/update.py: policy_update)
UPDATE_KEYS = ("loss", "grad_norm", "lr", "nonfinite_skipped", "update_tokens", "compute_dtype")


class PhaseTimer:
    """Wall-clock seconds per named phase of the current step, and on CUDA the peak memory each phase allocated
    (`torch.cuda.max_memory_allocated`, GB); the phase is also reported to the other ranks (`World.report`), so a
    failure can say where each rank stopped."""

    def __init__(self, world: World | None = None, step: int = 0):
        self.world = world
        self.cuda = world is not None and world.device.type == "cuda"
        self.start_step(step)

    def start_step(self, step: int) -> None:
        """Reset the times for step `step` (0-based)."""
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.step, self.phase = step, "start"

    @contextmanager
    def __call__(self, name: str):
        self.phase = name
        if self.world is not None:
            self.world.report(self.step + 1, name)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.world.device)
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.world.device) / 1e9
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)


def sampling_params(
    cfg: CohortConfig, slot_index: int, member_seed: int, step: int, first_position: int = 0, resample_round: int = 0
) -> SamplingParams:
    """A slot's sampling parameters at `step` for prompts from batch position `first_position` on; its seed
    is a pure function of (run, slot, step), so a resumed run samples exactly what the uninterrupted one
    would have (engines derive each prompt's stream from the seed and the prompt's batch position). A round of
    dynamic sampling (`resample_round` >= 1) has seeds of its own, its prompts' positions those of its questions."""
    r = cfg.rollout
    seed = (cfg.seed * 1_000_003 + (slot_index * 7919 + member_seed) * 104_729 + step + (resample_round << 32)) % (
        2**63
    )
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        seed=seed,
        first_position=first_position,
    )


def format_ok(text: str, style: str) -> bool:
    """Does a response use the member's answer format (a format reward's input)?"""
    return FORMAT_PATTERNS[style] in text


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
    Returned or raised, nothing the run built stays reachable (`vlm_corl.training.release`)."""
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
    cfg = run.cfg
    # A terminal gets tqdm's bar; a log file (stderr not a terminal) plain lines every ~5% (`progress_line`), not
    # the bar's carriage-return frames.
    shown = cfg.logging.progress and run.world.is_main
    bar = tqdm(
        range(run.start, cfg.train.max_steps),
        initial=run.start,
        total=cfg.train.max_steps,
        disable=not (shown and sys.stderr.isatty()),
        desc="cohort",
        dynamic_ncols=True,
    )
    every, started = max(1, cfg.train.max_steps // 20), time.perf_counter()
    stopped = None
    run.callbacks.fire("on_train_begin", run.start)
    stop = run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))  # a callback's StopTraining
    if cfg.eval.every and run.start == 0 and stop is None:  # the eval-drop flag's step-0 baseline, first best model
        with timer("eval"):
            eval_phase(run, 0)
        stop = run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
    teachers = {spec.id for spec in run.specs if spec.teacher}
    run.throughput = start_throughput(run.world, cfg, run.specs, lambda: timer.phase)  # metrics rows: speed
    for step in bar:
        if stop is not None:  # asked for before the first step: none runs
            break
        step_start = time.perf_counter()
        timer.start_step(step)
        rows, warnings = step_phases(run, step, timer, renders)
        learners = [r for r in rows if r["member"] not in teachers]  # an EMA teacher earns no reward
        if learners:
            bar.set_postfix(reward=" ".join(f"{r['reward_mean']:.2f}" for r in learners))
        if shown and bar.disable and ((step + 1) % every == 0 or step + 1 == cfg.train.max_steps):
            log.info(
                progress_line(
                    step + 1, cfg.train.max_steps, learners, (time.perf_counter() - started) / (step + 1 - run.start)
                )
            )
        if save_due(cfg.train, step + 1):
            with timer("checkpoint"):
                checkpoint_phase(run, step + 1, rows)
            run.callbacks.fire("on_save", step + 1, step + 1, latest_checkpoint(run.run_dir))
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            with timer("eval"):
                warnings += eval_phase(run, step + 1)
        if (step + 1) % cfg.logging.log_every == 0 and run.sink is not None:
            times = {f"time_{k}": v for k, v in timer.seconds.items()}
            times["time_step"] = time.perf_counter() - step_start  # everything but this write
            run.sink.write(run.throughput.fields([{**row, **times} for row in rows]))
        run.callbacks.fire("on_step_end", step + 1, step + 1, rows)
        if run.checkpoints is not None:
            run.checkpoints.poll()  # a background write done on every rank: the checkpoint is complete
        stop = run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
        run.nonfinite.observe(step + 1, run.updates, latest_checkpoint(run.run_dir), run.world.is_main)
        stopped = guard_phase(run, warnings)
        if stopped is not None:
            break
        if stop is not None:  # a callback's clean stop: the run ends here as at train.max_steps, checkpoint included
            if cfg.train.save_last and not save_due(cfg.train, step + 1):
                with timer("checkpoint"):
                    checkpoint_phase(run, step + 1, rows)
                run.callbacks.fire("on_save", step + 1, step + 1, latest_checkpoint(run.run_dir))
            break
    renders.close()
    if run.checkpoints is not None:
        run.checkpoints.wait()  # the last checkpoint is complete before the run reports it
    summary = finish_run(run, stopped, stop)
    run.callbacks.fire("on_train_end", cfg.train.max_steps if stop is None else stop["step"], summary)
    run.callbacks.agree(run.world, run.run_dir, latest_checkpoint(run.run_dir))
    if stopped is not None:
        raise CollapseStopped(stopped["message"])
    return summary


def save_due(train: TrainConfig, step: int) -> bool:
    """Does the loop write a checkpoint after `step` (1-based)? Every train.save_every steps, and at the last
    step unless train.save_last is off."""
    return bool(train.save_every and step % train.save_every == 0) or (train.save_last and step == train.max_steps)


def progress_line(step: int, total: int, rows: list[dict], seconds_per_step: float) -> str:
    """A plain progress line for a log file: step, share done, each member's mean reward, time per step."""
    rewards = ", ".join(f"{r['member']} {r['reward_mean']:.3f}" for r in rows)
    return f"step {step}/{total} ({100 * step / total:.0f}%): reward {rewards or '-'}; {seconds_per_step:.2f} s/step"


def step_phases(run: CohortRun, step: int, timer: PhaseTimer, renders: "RenderAhead") -> tuple[list, list]:
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
        lengths = exchanged[3]
    with timer("reward"):
        cohort, scored = reward_phase(run, batch, exchanged, step)
    resampled = {}
    if cfg.algo.resample_zero_variance:
        with timer("resample"):
            rolled = StepRollouts(renders.indices, batch, groups, exchanged, scored, rollout_s)
            rolled, resampled = resample_phase(run, renders, step, rolled)
        batch, groups, exchanged, scored = rolled.batch, rolled.groups, rolled.exchanged, rolled.scored
        rollout_s = rolled.rollout_s
        cohort, lengths = cohort_batch(run, batch, exchanged), exchanged[3]
    with timer("advantage"):
        advantages = [
            group_advantages(scored.rewards[n], cfg.algo.scale_rewards, cfg.algo.adv_eps) for n in range(len(run.specs))
        ]
    with timer("update"):
        updates = update_phase(run, groups, advantages, scored.rewards, lengths, step, truncated=exchanged[6])
    with timer("sync"):
        sync_phase(run)
    with timer("log"):
        updates, rollout_s, memory = _gather_step_facts(run, updates, rollout_s, timer)
        run.updates = updates  # every member's update stats, on every rank (the numerical guard reads them)
        if cfg.algo.rollout_is != "none":
            check_rollout_mismatch(step + 1, updates, cfg.algo.rollout_is_max_abs_dlogp, latest_checkpoint(run.run_dir))
        if not run.world.is_main:
            return [], []
        outcome = StepOutcome(
            step + 1,
            cohort,
            scored,
            [ex.answer for ex in batch],
            categories(batch, run.category_key),
            lengths,
            updates,
            rollout_s,
            memory,
            truncated=exchanged[6],
            resampled=resampled,
        )
        rows, warnings = metrics_rows(run, outcome)
        if samples_due(step + 1, cfg.logging.samples_every):
            settings = SampleSettings(
                cfg.reward.mode,
                cfg.reward.vote_threshold,
                cfg.logging.samples_per_step,
                run.category_key,
                views=tuple(s.view for s in run.specs),
                styles=tuple(run.prompt_styles.get(s.member_id) for s in run.specs),
            )
            sampled = sample_rows(step + 1, batch, cohort, scored, advantages, settings)
            run.sink.write_samples(sampled, step + 1)
        return rows, warnings


class RenderAhead:
    """The render phase with the next batch rendered (images decoded and preprocessed) in a background thread
    while this step rolls out and updates.

    An example whose prompt is longer than rollout.max_prompt_tokens for any member is skipped for every member
    (the cohort stays in lockstep): the ranks agree on such examples in the main thread, the sampler never draws
    them again and replaces them in this batch, and each is logged once and counted in summary.json."""

    def __init__(self, run: CohortRun):
        self.run, self.pending = run, None  # pending: (example indices, future of their render_phase)
        self.indices: list[int] = []  # the indices of the batch `prompts` gave last
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")

    def prompts(self, indices: list[int], step: int) -> tuple[list[Example], list[list]]:
        """This step's examples and prompts (`render_phase`), and the next step's started in the background.
        `self.indices`: the examples' indices (over-long ones replaced)."""
        ready = None
        if self.pending is not None:
            upcoming, future = self.pending
            rendered = future.result()  # the renderers are not thread-safe: the background render ends first
            ready = rendered if upcoming == indices else None  # stale when the sampler skipped examples since
        self.indices, batch, prompts = self._render(indices, ready)
        self._ahead(step)
        return batch, prompts

    def replacements(
        self, count: int, avoid: set[int], shards: dict[str, range], step: int
    ) -> tuple[list[int], list[Example], list[list]]:
        """`count` fresh examples for dynamic sampling, none of `avoid` (`LockstepSampler.draw`), their indices,
        examples and prompts for the positions `shards` give each member (over-long ones replaced as in a batch);
        the next step's batch then renders again in the background (the draws moved the stream on)."""
        if self.pending is not None:
            self.pending[1].result()  # the renderers are not thread-safe: the background render ends first
        indices, batch, prompts = self._render(self.run.sampler.draw(count, avoid), None, shards)
        self._ahead(step)
        return indices, batch, prompts

    def _render(
        self, indices: list[int], ready: tuple | None, shards: dict[str, range] | None = None
    ) -> tuple[list[int], list[Example], list[list]]:
        """Render `indices` (or take `ready`, their background render) until no prompt is too long for a member:
        such examples are agreed by every rank, never drawn again and replaced by the next of the stream."""
        run = self.run
        while True:
            batch = [run.examples[i] for i in indices]
            if ready is None:  # (the batch's render is called as in the background: with the run's shards)
                ready = render_phase(run, batch) if shards is None else render_phase(run, batch, shards)
            (prompts, too_long), ready = ready, None
            dropped = _agree_too_long(run, [(indices[p], *rest) for p, *rest in too_long])
            if not dropped:
                break
            indices = run.sampler.exclude(indices, dropped)
        return indices, batch, prompts

    def _ahead(self, step: int) -> None:
        """Start rendering the batch after `step` (0-based) in the background, if there is a next step."""
        run, self.pending = self.run, None
        if step + 1 < run.cfg.train.max_steps:
            upcoming = run.sampler.peek_batch()
            self.pending = (upcoming, self.pool.submit(render_phase, run, [run.examples[i] for i in upcoming]))

    def close(self) -> None:
        """Wait for the background render and end its thread (again: nothing to do)."""
        self.pool.shutdown()


def reward_phase(
    run: CohortRun, batch: list[Example], exchanged: list[list], step: int
) -> tuple[CohortBatch, RewardOutput]:
    """The rewards of `batch` (the step's, or a round of dynamic sampling's) from its exchanged fields: the
    mode's, plus the reward functions', plus DAPO's overlong penalty (algo.overlong_penalty)."""
    cfg = run.cfg
    cohort = cohort_batch(run, batch, exchanged)
    scored = run.reward_spec.fn(cohort, cfg.reward)
    if run.reward_funcs:
        values = function_rewards(run.reward_funcs, cohort, batch, run.specs, trained_slots(run), run.world, step + 1)
        scored = add_function_rewards(scored, values, run.reward_funcs)
    if cfg.algo.overlong_penalty:
        lengths = torch.tensor(exchanged[3], dtype=torch.float32)
        a = cfg.algo
        scored = add_overlong_penalty(
            scored, lengths, cfg.rollout.max_new_tokens, a.overlong_penalty, a.overlong_penalty_factor
        )
    return cohort, scored


def resample_phase(
    run: CohortRun, renders: RenderAhead, step: int, rolled: StepRollouts
) -> tuple[StepRollouts, dict[str, int]]:
    """DAPO's dynamic sampling (algo.resample_zero_variance): the step's questions no trained member learns from
    are replaced by fresh ones, round by round (`vlm_corl.training.dynamic_sampling`); returns the step's
    rollouts and the metrics {resampled_groups, resample_rounds, zero_variance_left}."""

    def again(positions: list[int], resample_round: int, avoid: set[int]) -> StepRollouts | None:
        count = min(len(positions), run.sampler.available(avoid))
        if count == 0:
            return None
        shards = sub_shards(run.shards, positions[:count])
        indices, batch, prompts = renders.replacements(count, avoid, shards, step)
        groups, seconds = rollout_phase(run, prompts, step, shards, resample_round)
        local = extract_phase(run, groups, batch, shards)
        exchanged = exchange(run.world, [ex.id for ex in batch], local, [s.id for s in run.specs])
        return StepRollouts(indices, batch, groups, exchanged, reward_phase(run, batch, exchanged, step)[1], seconds)

    owners = [_owner(s) for s in run.slots]
    return resample(rolled, trained_slots(run), run.cfg.algo.resample_max_rounds, again, run.shards, owners)


def trained_slots(run: CohortRun) -> list[bool]:
    """Per slot of the cohort: does its model train (a member's slots, not its EMA teacher, not a frozen peer)?"""
    trainable = {m.id: m.trainable for m in run.cfg.members}
    return [trainable[s.member_id] and not s.teacher for s in run.specs]


def cohort_batch(run: CohortRun, batch: list[Example], exchanged: list[list]) -> CohortBatch:
    """What the reward sees of the step from the exchanged fields (answers, format flags, texts, lengths,
    entropies, self-certainties, truncation flags; (N, B, K) each, `extract_phase`'s order): every slot's
    answers; gold answers only for a reward that reads them (`gt`), intrinsic scores only for one that needs them."""
    answers, formats, texts, _, entropy, certainty, _ = exchanged
    scores = {}
    if run.reward_spec.needs_scores:
        scores = {"entropy": torch.tensor(entropy).float(), "self_certainty": torch.tensor(certainty).float()}
    gold = [ex.answer for ex in batch] if run.reward_spec.uses_gold else [None] * len(batch)
    return CohortBatch(
        member_ids=tuple(s.id for s in run.specs),
        answers=answers,
        format_ok=formats,
        texts=texts,
        choices=[ex.choices for ex in batch],
        gold=gold,
        scores=scores,
    )


def guard_phase(run: CohortRun, warnings: list[dict]) -> dict | None:
    """`train.on_collapse` on this step's new warnings (world rank 0 holds them): None to go on, or, after a
    rollback where asked for, {action, warning, message} (every rank stops)."""
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
    return {"action": action, "warning": first, "message": stop_message(first, action, checkpoint)}


def eval_phase(run: CohortRun, step: int) -> list[dict]:
    """The in-loop evaluation at `step` (0: before the first update): rows to eval.jsonl and TensorBoard, each
    trained member's best model so far (eval.keep_best), and on world rank 0 the new eval-drop warnings."""
    rows = evaluate_cohort(run, run.cfg.eval, step)
    if run.cfg.eval.keep_best:
        keep_best(run, rows)
    if run.sink is None:
        return []
    run.sink.write_eval(rows)
    run.callbacks.fire("on_evaluate", step, step, rows)
    run.eval_history.extend(rows)
    max_drop = run.cfg.eval.max_category_drop
    new = [w for w in eval_drops(run.eval_history, max_drop) if w["step"] == step] if max_drop else []
    for w in new:
        log.warning(
            "possible collapse of %s in category %r at step %d: %s",
            w["slot"],
            w["category"],
            step,
            describe_collapse(w),
        )
    return new


def keep_best(run: CohortRun, rows: list[dict]) -> None:
    """Save the trained members whose score on eval.keep_best beat their best so far (every rank decides the
    same from the gathered rows; a member's ranks save together) and update best/best.json."""
    name = BENCHMARKS.get(run.cfg.eval.keep_best).name
    trained = {m.id for m in run.cfg.members if m.trainable}
    better = [r for r in improved(rows, name, run.best) if r["member"] in trained]
    for row in better:
        for m in run.members:
            if m.id == row["member"]:
                save_best(m, run.run_dir, writer=run.world.rank == run.placement[m.id][0])
        run.best[row["member"]] = {"step": row["step"], "benchmark": name, "score": row["score"]}
    run.world.barrier()
    if better and run.world.is_main:
        write_best(run.run_dir, run.best)


def categories(batch: list[Example], key: str | None) -> list[str | None]:
    """Each example's category (its metadata[logging.category_key], as a string), or None."""
    return [None if key is None or ex.metadata.get(key) is None else str(ex.metadata[key]) for ex in batch]

    # fmt: on


def render_phase(
    run: CohortRun, batch: list[Example], shards: dict[str, range] | None = None
) -> tuple[list[list], list[tuple[int, str, int]]]:
    """Each hosted slot's prompts for its member's shard of the batch (`shards`: other positions, a round of
    dynamic sampling's), and (batch position, member, tokens) of those longer than rollout.max_prompt_tokens
    (their place in the prompts holds None)."""
    shards = run.shards if shards is None else shards
    prompts, too_long = [], []
    for s in run.slots:
        mine = []
        for p in shards[_owner(s)]:
            try:
                mine.append(s.renderer(batch[p]))
            except PromptTooLong as err:
                mine.append(None)
                too_long.append((p, err.member, err.tokens))
        prompts.append(mine)
    return prompts, too_long


def _agree_too_long(run: CohortRun, found: list[tuple[int, str, int]]) -> set[int]:
    """The example indices some rank found too long for one of its members ((index, member, tokens) here),
    the same set on every rank; new ones are logged and kept for summary.json."""
    merged = {i: (member, tokens) for part in run.world.all_gather(found) for i, member, tokens in part}
    for i, (member, tokens) in sorted(merged.items()):
        if run.world.is_main and run.examples[i].id not in run.too_long:
            log.warning(
                "example %r renders to %d tokens for member %s, over rollout.max_prompt_tokens=%d: skipped for "
                "every member (%d so far; raise rollout.max_prompt_tokens or lower data.max_image_pixels to keep "
                "such examples)",
                run.examples[i].id,
                tokens,
                member,
                run.cfg.rollout.max_prompt_tokens,
                len(run.too_long) + 1,
            )
        run.too_long[run.examples[i].id] = {"member": member, "tokens": tokens}
    return set(merged)


def rollout_phase(
    run: CohortRun,
    prompts: list[list[Prompt]],
    step: int,
    shards: dict[str, range] | None = None,
    resample_round: int = 0,
) -> tuple[list, dict[str, float]]:
    """Each hosted slot samples K responses per prompt of its shard; returns its groups and rollout seconds.

    Samples are a pure function of (run seed, slot, step, batch position, k), so splitting the batch over
    more ranks draws the same responses. A round of dynamic sampling gives its questions' `shards` and its
    `resample_round` (its own seeds); a slot with no question there samples nothing."""
    groups, seconds = [], {}
    for s, slot_prompts in zip(run.slots, prompts):
        t0 = time.perf_counter()
        if shards is None:
            params = sampling_params(run.cfg, s.index, s.member.cfg.seed, step, run.shards[_owner(s)].start)
        else:
            start = shards[_owner(s)].start
            params = sampling_params(run.cfg, s.index, s.member.cfg.seed, step, start, resample_round)
        groups.append(s.engine.generate(slot_prompts, params) if slot_prompts else [])
        seconds[s.id] = time.perf_counter() - t0
    return groups, seconds


def extract_phase(
    run: CohortRun, groups: list[list[RolloutGroup]], batch: list[Example], shards: dict[str, range] | None = None
) -> dict[str, dict[int, tuple]]:
    """This process's rows for the exchange: {slot id: {batch position: (answers, format flags, texts,
    lengths, mean entropies, mean self-certainties, truncated)}}, K each; answers read in the member's prompt
    style; truncated: the response hit rollout.max_new_tokens without an end (the engine's finish_reason
    "length"). `shards`: the positions of a round of dynamic sampling."""
    shards = run.shards if shards is None else shards
    style = run.cfg.reward.answer_style
    scores = intrinsic_scores(run, groups) if run.reward_spec.needs_scores else None
    local = {}
    for n, (s, gs) in enumerate(zip(run.slots, groups)):
        read = s.member.prompt_style if style == "auto" else style
        rows = {}
        for j, (p, g) in enumerate(zip(shards[_owner(s)], gs)):
            k = len(g.responses)
            rows[p] = (
                [extract_answer(r.text, read, batch[p].choices) for r in g.responses],
                [format_ok(r.text, s.member.prompt_style) for r in g.responses],
                [r.text for r in g.responses],
                [len(r.token_ids) for r in g.responses],
                scores[n]["entropy"][j].tolist() if scores else [0.0] * k,
                scores[n]["self_certainty"][j].tolist() if scores else [0.0] * k,
                [r.finish_reason == "length" for r in g.responses],
            )
        local[s.id] = rows
    return local


def update_phase(
    run: CohortRun,
    groups: list[list[RolloutGroup]],
    advantages: list[torch.Tensor],
    rewards: torch.Tensor,
    lengths: list[list[list[int]]],
    step: int,
    truncated: list | None = None,
) -> dict:
    """Each hosted trainable member takes one optimizer step on its shard of all its slots' sequences
    (gradients summed over its ranks). An EMA teacher (co_rewarding_2) then moves toward its student.
    truncated: (N, B, K) responses cut at the length budget, left out of the loss with algo.mask_truncated.
    Returns {member id: update stats}."""
    cfg, updates = run.cfg, {}
    # Every engine sleeps for the update (vLLM sleep mode; sync_phase wakes them), a frozen peer's too, at level 1
    # (its weights backed up on the host, never pushed again): the memory plan frees them all for the update.
    for engine in {id(s.engine): s.engine for s in run.slots}.values():
        engine.sleep()
    for m in run.members:
        if not m.cfg.trainable:
            continue
        mine = [n for n, s in enumerate(run.slots) if s.member is m]
        masked = truncated if truncated is not None and cfg.algo.mask_truncated else None
        seqs = [
            seq
            for n in mine
            for seq in _sequences(
                groups[n],
                run.shards[m.id],
                advantages[run.slots[n].index],
                rewards[run.slots[n].index],
                cfg,
                None if masked is None else masked[run.slots[n].index],
            )
        ]
        trained = [n for n, spec in enumerate(run.specs) if spec.member_id == m.id and not spec.teacher]
        totals = batch_totals(
            [lengths[n] for n in trained],
            [rewards[n] for n in trained],
            cfg.algo.filter_zero_variance,
            None if masked is None else [masked[n] for n in trained],
        )
        # Even when every group was filtered out the member takes its (zero-gradient) optimizer step, exactly as
        # when every advantage is zero: the schedule and Adam's moments advance the same way in both cases.
        updates[m.id] = policy_update(m, seqs, cfg.algo, cfg.train, cfg.rollout, totals)
    decay = teacher_decay(step, cfg.train.max_steps, cfg.reward.teacher_decay_start, cfg.reward.teacher_decay_end)
    for s in run.slots:
        if s.follows is not None:  # an EMA teacher (co_rewarding_2)
            ema_update(s.member.model, s.follows.full_weights(), decay)
    return updates


def sync_phase(run: CohortRun) -> None:
    """The engines of trained members and EMA teachers load the new weights, so the next rollout samples from
    the updated policy (a no-op for the HF engine, which samples from the live module; frozen peers never
    re-sync); then every engine the update put to sleep wakes (weights first, then its KV cache)."""
    engines = {id(s.engine): s for s in run.slots}
    for s in engines.values():
        if s.member.cfg.trainable or s.follows is not None:
            s.engine.sync_weights()
    for s in engines.values():
        s.engine.wake()


def batch_totals(
    lengths: list[list[list[int]]],
    rewards: list[torch.Tensor],
    filter_zero_variance: bool,
    masked: list[list[list[bool]]] | None = None,
) -> tuple[int, int]:
    """(response tokens, responses) a member trains on over the whole batch, all its ranks and slots: the
    loss normaliser, so that the ranks' shares add up to the full-batch loss. lengths, rewards: (B, K) each;
    masked: (B, K) each, responses left out of the loss (algo.mask_truncated)."""
    tokens = seqs = 0
    for n, (lens, r) in enumerate(zip(lengths, rewards)):
        keep = nonzero_variance_groups(r) if filter_zero_variance else torch.ones(len(lens), dtype=torch.bool)
        for b, (row, k) in enumerate(zip(lens, keep.tolist())):
            kept = [t for i, t in enumerate(row) if k and (masked is None or not masked[n][b][i])]
            tokens, seqs = tokens + sum(kept), seqs + len(kept)
    return tokens, seqs


def _sequences(
    groups, positions: range, advantages: torch.Tensor, rewards: torch.Tensor, cfg, masked: list | None = None
) -> list[Sequence]:
    """One slot's sequences at its batch `positions` (those of zero-variance groups marked untrained when
    algo.filter_zero_variance, and those `masked`, (B, K), with algo.mask_truncated). advantages, rewards:
    (B, K) over the whole batch."""
    keep = (
        nonzero_variance_groups(rewards)
        if cfg.algo.filter_zero_variance
        else torch.ones(len(rewards), dtype=torch.bool)
    )
    return [
        Sequence(
            g.prompt.inputs,
            r.token_ids,
            float(advantages[p, k]),
            trained=bool(keep[p]) and not (masked is not None and masked[p][k]),
            rollout_logprobs=r.token_logprobs,
        )
        for p, g in zip(positions, groups)
        for k, r in enumerate(g.responses)
    ]


def intrinsic_scores(run: CohortRun, groups: list[list[RolloutGroup]]) -> list[dict[str, torch.Tensor]]:
    """Per hosted slot, (G, K) per-response mean entropy and self-certainty of its shard: from the rollout
    where the engine recorded them (HF), else from one batched scoring pass (vLLM returns only top-k log-probs)."""
    per_slot = []
    for s, gs in zip(run.slots, groups):
        responses = [r for g in gs for r in g.responses]
        if not responses and not s.member.partitioned:  # no question of a resampling round on this rank
            per_slot.append({})
            continue
        if not responses:  # its ranks' scoring passes are collectives: this rank would have none to run
            raise NotImplementedError(
                f"member {s.member.id!r} (ZeRO-3, partitioned) has no question of this round of dynamic sampling "
                "on this rank to score for the intrinsic reward: algo.resample_zero_variance does not support "
                "this layout yet; turn it off or place the member on one rank"
            )
        if all(r.entropy_sum is not None for r in responses):
            stats = {k: torch.tensor([r.mean(k) for r in responses]) for k in ("entropy", "self_certainty")}
        else:
            m, size = s.member, run.cfg.train.micro_batch_size
            # A partitioned ZeRO-3 member scores through its engine: its ranks run as many passes (fillers).
            passes = m.micro_batch_count(-(-len(responses) // size)) if m.partitioned else None
            with m.autocast(), m.updating():
                stats = response_token_stats(
                    m.scoring_module,
                    [g.prompt.inputs for g in gs for _ in g.responses],
                    [r.token_ids for r in responses],
                    m.policy(run.cfg.rollout.temperature),
                    micro_batch_size=size,
                    passes=passes,
                )
        per_slot.append({k: v.float().cpu().view(len(gs), -1) for k, v in stats.items()})
    return per_slot


def checkpoint_phase(run: CohortRun, step: int, rows: list[dict]) -> None:
    """Every rank takes part; each model's first rank writes it, world rank 0 the cohort state (atomic).

    The step's metrics rows go into the cohort state too: they are written to metrics.jsonl after the
    checkpoint, and a run killed in between gets them back on resume."""
    models = models_to_save(run.slots)
    replicas = _check_replicas(run, models)
    writers = {s.member.id: run.world.rank == run.placement[_owner(s)][0] for s in run.slots}
    required = {}
    for spec in run.specs:
        cfg_of = next(m for m in run.cfg.members if m.id == spec.member_id)
        model_id = spec.id if spec.teacher else spec.member_id
        own = cfg_of.trainable and not spec.teacher
        required[model_id] = required_files(trainable=own, lora=own and cfg_of.lora is not None)
        if run.cfg.train.deepspeed and cfg_of.trainable and not spec.teacher:  # one optimizer partition per rank
            required[model_id] = required[model_id][:-1] + state_files(len(run.placement[spec.member_id]))
    state = {"sampler": run.sampler.state_dict(), "members": required, "rows": rows, "replicas": replicas}
    state["config"] = config_to_dict(run.cfg)  # what the checkpoint means: a resume compares its own with it
    state["data"] = run.data  # what it trained on, by content: a resume compares it (checkpoint.check_resumed_data)
    # the reward functions (reward.custom's and the API's, which config.yaml cannot hold): the model card names them
    state["reward_functions"] = [{"function": function_name(f.fn), "weight": f.weight} for f in run.reward_funcs]
    written = [(m, writers[m.id]) for m in models]
    if run.checkpoints is not None:  # train.async_checkpoint: host copies now, the files in the background
        run.checkpoints.save(step, written, state)
    else:
        save_checkpoint(run.world, run.run_dir, step, written, state, run.cfg.train.keep_last)


def _check_replicas(run: CohortRun, models) -> dict[str, dict[int, float]]:
    """Every rank of a member must hold the same weights (data parallel keeps them so); a divergence is a
    bug that would silently corrupt the saved member, so it stops the run."""
    sums: dict[str, dict[int, float]] = {}
    for rank, part in enumerate(
        run.world.all_gather({m.id: weights_checksum(t for _, t in m.full_weights()) for m in models})
    ):
        for mid, value in part.items():
            sums.setdefault(mid, {})[rank] = value
    broken = [mid for mid, by_rank in sums.items() if not all(math.isfinite(v) for v in by_rank.values())]
    if broken:  # the numerical guard skips non-finite updates: a member's weights should never get here
        last = latest_checkpoint(run.run_dir)
        raise NonFiniteStopped(
            f"numerical guard: the weights of {', '.join(map(repr, broken))} are not finite; no checkpoint was "
            f"written with them ({f'the last complete one is {last}' if last else 'none was written before'})"
        )
    diverged = {mid: by_rank for mid, by_rank in sums.items() if len(set(by_rank.values())) > 1}
    if diverged:
        raise RuntimeError(f"the ranks of a member hold different weights: {diverged}")
    return sums  # {model id: {rank: checksum}}, recorded in the checkpoint's manifest


def _owner(slot: Slot) -> str:
    """The member whose ranks host `slot` (a teacher lives with its student)."""
    return slot.follows.id if slot.follows is not None else slot.member.id


def _gather_step_facts(run: CohortRun, updates: dict, rollout_s: dict, timer: PhaseTimer) -> tuple[dict, dict, dict]:
    """Every member's update stats (from its first rank; identical on the others), each slot's rollout seconds
    (the slowest of its ranks), and each slot's memory (the largest of its ranks): its renderer's prompt cache
    (MB, host) and, on CUDA, the peak each phase so far allocated on its device (GB), on every rank, with the
    memory plan's peak for the rank (`plan_gb`) and the largest measured peak over it (`peak_over_plan`)."""
    mine = {
        s.id: {
            "prompt_cache_mb": s.renderer.cached_bytes / 2**20,
            **{f"peak_gb_{k}": v for k, v in timer.peaks.items()},
            **against_plan(run.plan, run.world.rank, timer.peaks),
        }
        for s in run.slots
    }
    updates_all, seconds, memory = {}, {}, {}
    for part in run.world.all_gather((updates, rollout_s, mine)):
        for mid, stats in part[0].items():
            updates_all.setdefault(mid, stats)
        for sid, sec in part[1].items():
            seconds[sid] = max(seconds.get(sid, 0.0), sec)
        for sid, values in part[2].items():
            slot = memory.setdefault(sid, {})
            for k, v in values.items():
                slot[k] = max(slot.get(k, 0.0), v)
    return updates_all, seconds, memory


def evaluate_cohort(run: CohortRun, eval_cfg: EvalConfig, step: int) -> list[dict]:
    """The eval hook: every member on every configured benchmark, the questions split over the member's ranks
    (each rank answers its contiguous share, so no rank waits idle in a collective for a whole evaluation);
    one row per member and benchmark, from all its ranks' records, gathered on every rank."""
    rows = []
    for name in eval_cfg.benchmarks:
        bench = BENCHMARKS.get(name)
        if eval_cfg.max_new_tokens:
            bench = replace(bench, max_new_tokens=eval_cfg.max_new_tokens)
        bench = replace(bench, temperature=eval_cfg.temperature)
        examples = benchmark_examples(bench, eval_cfg.limit)
        shares = {}
        for m in run.members:
            engine, room = _eval_engine(run, m, bench)
            mine = shard(len(examples), run.placement[m.id], run.world.rank)
            records, answered = sample_records(
                m, examples[mine.start : mine.stop], bench, engine=engine, max_prompt_tokens=room
            )
            shares[m.id] = (records, [mine.start + i for i in answered])
        merged: dict[str, tuple[list, list]] = {}
        for part in run.world.all_gather(shares):  # rank order: a member's shards in question order
            for mid, (records, answered) in part.items():
                merged.setdefault(mid, ([], []))
                merged[mid][0].extend(records)
                merged[mid][1].extend(answered)
        for mid, (records, answered) in merged.items():
            result = score_records(records, [examples[i] for i in answered], bench)
            counts = Counter(r["type"] for r in records if r["type"] is not None)
            rows.append(
                {
                    "step": step,
                    "member": mid,
                    "benchmark": bench.name,
                    "score": result["score"],
                    "accuracy": result["accuracy"],
                    "n": result["n"],
                    "skipped_too_long": len(examples) - len(answered),
                    **{f"accuracy_{t}": a for t, a in result["by_type"].items()},
                    **{f"n_{t}": counts[t] for t in result["by_type"]},
                }
            )
    return rows


def _eval_engine(run: CohortRun, member, bench):
    """(engine, longest prompt) for an in-loop evaluation: the member's own vLLM rollout engine (synced after
    every update; a partitioned ZeRO-3 member has no module the HF engine could run) with what its sequence
    length leaves after the benchmark's answer, or the HF engine (None: evaluate_member's default)."""
    r = run.cfg.rollout
    if member_engine(run.cfg, member.cfg) != "vllm":
        return None, 1 << 30
    return next(
        s.engine for s in run.slots if s.member is member
    ), r.max_prompt_tokens + r.max_new_tokens - bench.max_new_tokens


@dataclass
class StepOutcome:
    """What one step leaves for its metrics rows: the cohort batch and its rewards, the gold answers and
    categories of its questions (diagnostics only), response lengths, update stats, rollout seconds and memory."""

    step: int
    cohort: CohortBatch
    scored: object  # vlm_corl.training.rewards.RewardOutput
    gold: list
    categories: list  # (B,) str | None
    lengths: list  # (N, B, K)
    updates: dict  # member id -> update stats
    rollout_s: dict  # slot id -> seconds
    memory: dict = field(default_factory=dict)  # slot id -> {prompt_cache_mb, peak_gb_<phase> (CUDA)}
    truncated: list | None = None  # (N, B, K) responses cut at rollout.max_new_tokens
    resampled: dict = field(default_factory=dict)  # algo.resample_zero_variance's counts (cohort-wide)


def overlong_metrics(algo, truncated: list, n: int) -> dict:
    """With algo.overlong_penalty or algo.mask_truncated: slot n's share of responses cut at the length budget
    (`truncated_frac`; with mask_truncated, those are the responses left out of the loss)."""
    if not (algo.overlong_penalty or algo.mask_truncated):
        return {}
    flags = [t for group in truncated[n] for t in group]
    return {"truncated_frac": sum(flags) / max(len(flags), 1)}


def metrics_rows(run: CohortRun, o: StepOutcome) -> tuple[list[dict], list[dict]]:
    """One metrics row per slot (per member, in the usual layout), update stats on the member's first slot;
    and the collapse warnings first raised by these rows.

    Cohort-level diagnostics (unanimity) are the same in every row. With logging.category_key, each row also
    holds the step's per-category sums and their running means over logging.category_window steps
    (vlm_corl.training.category_metrics). The collapse detector runs on the run so far (`run.collapse`) plus these,
    sets `collapse_flag`/`collapse_on` and logs a slot's first detections (vlm_corl.training.collapse)."""
    rows, reported = [], set()
    unanimous = cohort_unanimity(o.cohort, o.gold, run.cfg.reward.vote_threshold)
    shared = unanimity(unanimous)
    pairs = pairwise_agreement(o.cohort, run.cfg.reward.vote_threshold)
    for n, s in enumerate(run.specs):
        row = {"step": o.step, "member": s.id}
        row.update(member_metrics(n, o.cohort, o.scored, o.lengths[n], o.gold))
        row.update(pairs[n])
        row.update(shared)
        if any(c is not None for c in o.categories):
            row["category_stats"] = category_step_stats(n, o.cohort, o.scored, o.categories, o.gold, unanimous)
            mine = [r.get("category_stats") for r in run.collapse.recent.get(s.id, ())]
            row.update(window_metrics(mine + [row["category_stats"]]))
        stats = o.updates.get(s.member_id, {}) if s.member_id not in reported else {}
        reported.add(s.member_id)
        row.update({k: stats.get(k) for k in UPDATE_KEYS})
        row.update({k: v for k, v in stats.items() if k.startswith("is_")})  # algo.rollout_is mismatch
        row["tokens_per_s"] = sum(map(sum, o.lengths[n])) / o.rollout_s[s.id]
        if o.truncated is not None:
            row.update(overlong_metrics(run.cfg.algo, o.truncated, n))
        row.update(o.resampled)
        row.update(o.memory.get(s.id, {}))
        rows.append(row)
    return rows, run.collapse.flag(rows)

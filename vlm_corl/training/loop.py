"""The cohort training loop: one short function of named, timed phases.

sample → render → rollout → extract → exchange → reward → advantage → update → log → checkpoint → eval
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import NoReturn

import torch
from tqdm import tqdm

from vlm_corl.config import CohortConfig, ConfigError, save_config
from vlm_corl.config.schema import DatasetConfig, EvalConfig
from vlm_corl.data.answers import extract_answer
from vlm_corl.data.loaders import DataError, load_examples
from vlm_corl.data.paraphrases import apply_paraphrases, read_cache
from vlm_corl.data.records import Example
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.distributed.checkpoint import (
    latest_checkpoint,
    load_cohort_state,
    required_files,
    restore_rng,
    save_checkpoint,
)
from vlm_corl.distributed.exchange import exchange
from vlm_corl.distributed.world import (
    CollectiveError,
    World,
    build_groups,
    describe,
    failure_report,
    launch_world,
    place_members,
    shard,
    weights_checksum,
)
from vlm_corl.errors import Interrupted
from vlm_corl.evaluation.scoring import benchmark_examples, evaluate_member
from vlm_corl.members.deepspeed_update import state_files
from vlm_corl.members.member import Member, check_modality, load_member, member_family
from vlm_corl.members.rollout import Prompt, RolloutGroup, SamplingParams
from vlm_corl.members.update import Sequence, policy_update, response_token_stats
from vlm_corl.registry import BENCHMARKS
from vlm_corl.training.category_metrics import category_step_stats, window_metrics
from vlm_corl.training.collapse import collapse_warnings, eval_drops, flag_step
from vlm_corl.training.collapse import describe as describe_collapse
from vlm_corl.training.grpo import group_advantages, nonzero_variance_groups
from vlm_corl.training.guard import (
    BEST_DIR,
    CollapseStopped,
    improved,
    read_best,
    roll_back,
    save_best,
    stop_message,
    write_best,
)
from vlm_corl.training.metrics import MetricsSink, cohort_unanimity, member_metrics, unanimity
from vlm_corl.training.rewards import CohortBatch, RewardSpec, resolve_reward
from vlm_corl.training.slots import (
    Slot,
    SlotSpec,
    build_slots,
    check_views,
    ema_update,
    models_to_save,
    slot_specs,
    teacher_decay,
)

log = logging.getLogger("vlm_corl")

FORMAT_PATTERNS = {"boxed": "\\boxed{", "answer_tags": "<answer>"}


class PhaseTimer:
    """Wall-clock seconds per named phase of the current step; the phase is also reported to the other ranks
    (`World.report`), so a failure can say where each rank stopped."""

    def __init__(self, world: World | None = None, step: int = 0):
        self.world = world
        self.start_step(step)

    def start_step(self, step: int) -> None:
        """Reset the times for step `step` (0-based)."""
        self.seconds: dict[str, float] = {}
        self.step, self.phase = step, "start"

    @contextmanager
    def __call__(self, name: str):
        self.phase = name
        if self.world is not None:
            self.world.report(self.step + 1, name)
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def sampling_params(
    cfg: CohortConfig, slot_index: int, member_seed: int, step: int, first_position: int = 0
) -> SamplingParams:
    """A slot's sampling parameters at `step` for prompts from batch position `first_position` on; its seed
    is a pure function of (run, slot, step), so a resumed run samples exactly what the uninterrupted one
    would have (engines derive each prompt's stream from the seed and the prompt's batch position)."""
    r = cfg.rollout
    seed = (cfg.seed * 1_000_003 + (slot_index * 7919 + member_seed) * 104_729 + step) % (2**63)
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


@dataclass
class CohortRun:
    """Everything a run holds between steps: data order, placement, this process's members and slots, sinks."""

    cfg: CohortConfig
    run_dir: Path
    world: World
    placement: dict[str, tuple[int, ...]]  # member id -> its ranks (vlm_corl.distributed.world)
    examples: list
    sampler: LockstepSampler
    members: list  # the configured members this process hosts (trained, or frozen peers)
    specs: list[SlotSpec]  # every slot of the cohort, in exchange order
    slots: list[Slot]  # the slots this process hosts (vlm_corl.training.slots)
    shards: dict[str, range]  # member id -> the batch positions this process rolls out and trains on
    sink: MetricsSink | None  # world rank 0 only
    reward_spec: RewardSpec
    start: int
    history: list[dict]  # metrics rows so far (restored from metrics.jsonl on resume; rank 0)
    data_report: object = None  # vlm_corl.data.loaders.LoadReport: records kept and skipped (into summary.json)
    eval_history: list[dict] = field(default_factory=list)  # in-loop evaluation rows so far (rank 0)
    best: dict = field(default_factory=dict)  # member id -> {step, benchmark, score} of its kept best model


class RankFailure(RuntimeError):
    """Another rank died or hung: this rank stops with a report of where every rank was (no traceback)."""


def run_cohort(cfg: CohortConfig) -> dict:
    """Train the cohort described by `cfg`; returns the summary also written to summary.json (by rank 0)."""
    run = start_run(cfg)
    timer = PhaseTimer(run.world, run.start)
    try:
        with stopped_by_launcher(run.world):
            return train_steps(run, timer)
    except KeyboardInterrupt:
        last = latest_checkpoint(run.run_dir)
        resume = f"resume from {last} with train.resume=true" if last else "no checkpoint was written yet"
        raise Interrupted(f"interrupted at step {timer.step + 1} ({timer.phase}); {resume}") from None
    except CollectiveError as err:
        if run.world.distributed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop may not cut the report short
        raise RankFailure(
            failure_report(run.world, run.placement, err, timer.step + 1, timer.phase, latest_checkpoint(run.run_dir))
        ) from err


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


def train_steps(run: CohortRun, timer: PhaseTimer) -> dict:
    """The step loop from `run.start` to train.max_steps; `timer` is renewed each step (phases and times)."""
    cfg = run.cfg
    bar = tqdm(
        range(run.start, cfg.train.max_steps),
        initial=run.start,
        total=cfg.train.max_steps,
        disable=not (cfg.logging.progress and run.world.is_main),
        desc="cohort",
        dynamic_ncols=True,
    )
    renders, stopped = RenderAhead(run), None
    if cfg.eval.every and run.start == 0:  # the step-0 baseline of the eval-drop flag and the first best model
        with timer("eval"):
            eval_phase(run, 0)
    for step in bar:
        step_start = time.perf_counter()
        timer.start_step(step)
        rows, warnings = step_phases(run, step, timer, renders)
        if rows:
            bar.set_postfix(reward=" ".join(f"{r['reward_mean']:.2f}" for r in rows))
        if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0 or step + 1 == cfg.train.max_steps:
            with timer("checkpoint"):
                checkpoint_phase(run, step + 1, rows)
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            with timer("eval"):
                warnings += eval_phase(run, step + 1)
        if (step + 1) % cfg.logging.log_every == 0 and run.sink is not None:
            times = {f"time_{k}": v for k, v in timer.seconds.items()}
            times["time_step"] = time.perf_counter() - step_start  # everything but this write
            run.sink.write([{**row, **times} for row in rows])
        stopped = guard_phase(run, warnings)
        if stopped is not None:
            break
    renders.close()
    summary = finish_run(run, stopped)
    if stopped is not None:
        raise CollapseStopped(stopped["message"])
    return summary


def step_phases(run: CohortRun, step: int, timer: PhaseTimer, renders: "RenderAhead") -> tuple[list, list]:
    """One step from sampling to the log phase (0-based `step`): world rank 0's metrics rows and the collapse
    warnings they raised (empty on the other ranks)."""
    cfg = run.cfg
    with timer("sample"):
        batch = [run.examples[i] for i in run.sampler.next_batch()]
    with timer("render"):
        prompts = renders.prompts(batch, step)
    with timer("rollout"):
        groups, rollout_s = rollout_phase(run, prompts, step)
    with timer("extract"):
        local = extract_phase(run, groups, batch)
    with timer("exchange"):
        exchanged = exchange(run.world, [ex.id for ex in batch], local, [s.id for s in run.specs])
        lengths = exchanged[3]
    with timer("reward"):
        cohort = cohort_batch(run, batch, exchanged)
        scored = run.reward_spec.fn(cohort, cfg.reward)
    with timer("advantage"):
        advantages = [
            group_advantages(scored.rewards[n], cfg.algo.scale_rewards, cfg.algo.adv_eps) for n in range(len(run.specs))
        ]
    with timer("update"):
        updates = update_phase(run, groups, advantages, scored.rewards, lengths, step)
    with timer("sync"):
        sync_phase(run)
    with timer("log"):
        updates, rollout_s = _gather_step_facts(run.world, updates, rollout_s)
        if not run.world.is_main:
            return [], []
        outcome = StepOutcome(
            step + 1,
            cohort,
            scored,
            [ex.answer for ex in batch],
            categories(batch, cfg.logging.category_key),
            lengths,
            updates,
            rollout_s,
        )
        rows, warnings = metrics_rows(run, outcome)
        run.history.extend(rows)
        return rows, warnings


class RenderAhead:
    """The render phase with the next batch rendered (images decoded and preprocessed) in a background thread
    while this step rolls out and updates; collecting it then only reads the renderers' caches."""

    def __init__(self, run: CohortRun):
        self.run, self.pending = run, None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")

    def prompts(self, batch: list[Example], step: int) -> list[list]:
        """This step's prompts (`render_phase`), and the next step's started in the background."""
        if self.pending is not None:
            self.pending.result()
        prompts = render_phase(self.run, batch)
        if step + 1 < self.run.cfg.train.max_steps:
            upcoming = [self.run.examples[i] for i in self.run.sampler.peek_batch()]
            self.pending = self.pool.submit(render_phase, self.run, upcoming)
        return prompts

    def close(self) -> None:
        self.pool.shutdown()


def cohort_batch(run: CohortRun, batch: list[Example], exchanged: list[list]) -> CohortBatch:
    """What the reward sees of the step from the exchanged fields (answers, format flags, texts, lengths,
    entropies, self-certainties; (N, B, K) each, `extract_phase`'s order): every slot's answers; gold answers
    only for a reward that reads them (`gt`), intrinsic scores only for one that needs them."""
    answers, formats, texts, _, entropy, certainty = exchanged
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


def finish_run(run: CohortRun, stopped: dict | None) -> dict:
    """The run's summary (written by rank 0 to summary.json): last metrics per member, collapse warnings, the
    guard's stop, best models, data records kept and skipped, and the environment."""
    fallbacks = {
        sid: n
        for part in run.world.all_gather({s.id: s.renderer.view_fallbacks for s in run.slots})
        for sid, n in part.items()
    }
    summary = _summary(run.cfg, run.history, run.run_dir, fallbacks)
    if run.cfg.eval.max_category_drop:
        summary["collapse_warnings"] += eval_drops(run.eval_history, run.cfg.eval.max_category_drop)
    summary["stopped_by_guard"] = None if stopped is None else {k: stopped[k] for k in ("action", "warning")}
    summary["best"] = run.best or None
    report = run.data_report
    summary["data"] = {"kept": report.kept, "skipped": report.skipped, "skipped_examples": report.samples}
    summary["environment"] = environment(run.world)
    if run.sink is not None:
        run.sink.close()
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


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


def start_run(cfg: CohortConfig) -> CohortRun:
    """Join the launch, place members on ranks, load data and this process's members, build their slots
    (engines, renderers), and restore the newest checkpoint if resuming."""
    world = launch_world(cfg.train.dist_timeout_s, need_group=cfg.train.deepspeed is not None)
    placement = place_members(cfg.members, world.size)
    build_groups(world, placement, every=cfg.train.deepspeed is not None)
    run_dir = Path(cfg.output_dir)
    resume_from = _resume_point(cfg, run_dir)
    state = load_cohort_state(resume_from) if resume_from else None
    if state is not None and state["step"] >= cfg.train.max_steps:  # before anything expensive is loaded
        raise ConfigError(
            [
                f"train.max_steps={cfg.train.max_steps} but {resume_from} is already at step "
                f"{state['step']}: raise train.max_steps to train further, or start a new output_dir"
            ],
            ["train.max_steps"],
        )
    if resume_from is None:
        _claim_run_dir(cfg, run_dir, clear=world.is_main)
    world.barrier()  # every rank has looked at the run directory before anything new is written
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        log.info("placement over %d process(es): %s", world.size, describe(placement))
    torch.manual_seed(cfg.seed)
    reward_spec = resolve_reward(cfg.reward)
    examples, data_report = _load_data(cfg, resume_from)
    sampler = LockstepSampler(len(examples), cfg.data.batch_size, cfg.data.seed, cfg.data.shuffle)
    specs = slot_specs(cfg.members, reward_spec.layout)
    lacking = check_views(examples, specs, cfg.data.view_fallback)
    if lacking and world.is_main:
        log.warning("examples without a slot's view, rendered in the original wording: %s", lacking)
    _check_shards(cfg, placement)
    members = load_hosted_members(cfg, world, placement, resume_from)
    max_images = max(len(ex.images) for ex in examples)
    slots = build_slots(cfg, members, specs, max_images, resume_from)
    shards = {m.id: shard(cfg.data.batch_size, placement[m.id], world.rank) for m in members}
    sink = MetricsSink(run_dir, cfg.logging.tensorboard) if world.is_main else None
    start, history, eval_history = _restore(state, sampler, world, sink)
    if state is not None:
        log.info("resumed from %s (step %d)", resume_from, start)
    # fmt: off
    return CohortRun(cfg, run_dir, world, placement, examples, sampler, members, specs, slots, shards, sink,
                     reward_spec, start, history, data_report, eval_history, read_best(run_dir))
    # fmt: on


def _load_data(cfg: CohortConfig, resume_from: Path | None) -> tuple[list[Example], object]:
    """The training examples (with their paraphrases, when configured) and the loader's report, after checking
    that every member can read them."""
    examples, data_report = load_training_examples(cfg.data.train)
    if cfg.data.paraphrases:  # a cache from `python -m data_tools.paraphrase`, aligned by example id
        examples, report = apply_paraphrases(examples, read_cache(cfg.data.paraphrases))
        log.info("paraphrases: %s", report.summary())
    _check_members_read_the_data(cfg, examples, resume_from)
    return examples, data_report


def _restore(state: dict | None, sampler: LockstepSampler, world: World, sink) -> tuple[int, list, list]:
    """(start step, metrics history, eval history) of a resumed run, with the sampler and random streams
    restored, and the metrics rows after the checkpoint dropped; (0, [], []) for a new run."""
    if state is None:
        return 0, [], []
    start, history, eval_history = state["step"], [], []
    sampler.load_state_dict(state["sampler"])
    restore_rng(state["rng"], world)
    if sink is not None:
        history, eval_history = sink.truncate_after(start)
        if not any(row["step"] == start for row in history):  # killed between checkpoint and metrics write
            sink.write(state.get("rows", []))
            history += state.get("rows", [])
    return start, history, eval_history


def load_hosted_members(cfg: CohortConfig, world: World, placement: dict, resume_from: Path | None) -> list:
    """The members placed on this rank, loaded (from the checkpoint when resuming) with their group, and the
    trainable ones with their optimizer and schedule (restored when resuming), DeepSpeed engine and KL anchor."""
    mine = [m for m in cfg.members if world.rank in placement[m.id]]
    members = [load_member(m, resume_from / m.id if resume_from else None, world.device) for m in mine]
    for m in members:
        m.group = world.group(placement[m.id])
        if not m.cfg.trainable:
            continue
        # one optimizer step per pass over a rollout batch: the schedule spans all of them
        m.setup_optimizer(cfg.train, cfg.train.max_steps * cfg.algo.updates_per_batch)
        if cfg.train.deepspeed:
            attach_deepspeed(m, cfg, world, placement[m.id])
        if resume_from:
            m.load_trainer_state(resume_from / m.id)
        if cfg.algo.kl_beta > 0:  # the KL anchor is the member's initial model, also after a resume
            m.reference = load_member(replace(m.cfg, trainable=False), device=world.device).model.eval()
    return members


def attach_deepspeed(member: Member, cfg: CohortConfig, world: World, ranks: tuple[int, ...]) -> None:
    """Give a trainable member a DeepSpeed engine over its ranks (its AdamW and schedule are already built).
    Under ZeRO-3 only the HF rollout engine needs a full copy of the weights beside the partitions."""
    from vlm_corl.members.deepspeed_update import DeepSpeedUpdate, load_deepspeed_config

    train = cfg.train
    ds_config = load_deepspeed_config(train.deepspeed, train.grad_clip, len(ranks))
    member.deepspeed = DeepSpeedUpdate(
        member,
        ds_config,
        world.group(ranks),
        world.singles[world.rank],
        keep_full_copy=cfg.rollout.engine == "hf",
        bucket_bytes=int(train.gather_bucket_mb * (1 << 20)),
    )
    if member.deepspeed.full_copy is not None and world.rank == ranks[0]:
        log.info(
            "ZeRO-3 member %s keeps a full fp32 copy of its weights for HF rollouts (rollout.engine=vllm "
            "streams them instead)",
            member.id,
        )


def _check_members_read_the_data(cfg: CohortConfig, examples, resume_from: Path | None) -> None:
    """Before any model is loaded: every member's directory names a family (agreeing with members[i].family),
    and text-only members get no images."""
    if resume_from is not None:
        held = sorted(p.name for p in resume_from.iterdir() if p.is_dir())
        renamed = [m.id for m in cfg.members if m.id not in held]
        if renamed:
            raise ConfigError(
                [
                    f"the checkpoint to resume, {resume_from}, holds members {held} but the config has "
                    f"{renamed}: members are matched by id, so use the ids of the run you resume (or "
                    "start a new run in another output_dir)"
                ],
                ["members"],
            )
    for i, m in enumerate(cfg.members):
        check_modality(
            member_family(m, resume_from / m.id if resume_from else m.model),
            examples,
            f"members[{i}] ({m.id!r}, {m.model})",
        )


def _check_shards(cfg: CohortConfig, placement: dict[str, tuple[int, ...]]) -> None:
    widest = max(len(r) for r in placement.values())
    if cfg.data.batch_size < widest:
        raise ConfigError(
            [
                f"data.batch_size={cfg.data.batch_size} is smaller than the {widest} ranks of a member: "
                "every rank needs at least one example per step; raise data.batch_size"
            ],
            ["data.batch_size"],
        )


def render_phase(run: CohortRun, batch: list[Example]) -> list[list]:
    """Each hosted slot's prompts for its member's shard of the batch."""
    return [[s.renderer(batch[p]) for p in run.shards[_owner(s)]] for s in run.slots]


def rollout_phase(run: CohortRun, prompts: list[list[Prompt]], step: int) -> tuple[list, dict[str, float]]:
    """Each hosted slot samples K responses per prompt of its shard; returns its groups and rollout seconds.

    Samples are a pure function of (run seed, slot, step, batch position, k), so splitting the batch over
    more ranks draws the same responses."""
    groups, seconds = [], {}
    for s, slot_prompts in zip(run.slots, prompts):
        t0 = time.perf_counter()
        params = sampling_params(run.cfg, s.index, s.member.cfg.seed, step, run.shards[_owner(s)].start)
        groups.append(s.engine.generate(slot_prompts, params))
        seconds[s.id] = time.perf_counter() - t0
    return groups, seconds


def extract_phase(
    run: CohortRun, groups: list[list[RolloutGroup]], batch: list[Example]
) -> dict[str, dict[int, tuple]]:
    """This process's rows for the exchange: {slot id: {batch position: (answers, format flags, texts,
    lengths, mean entropies, mean self-certainties)}}, K each; answers read in the member's prompt style."""
    style = run.cfg.reward.answer_style
    scores = intrinsic_scores(run, groups) if run.reward_spec.needs_scores else None
    local = {}
    for n, (s, gs) in enumerate(zip(run.slots, groups)):
        read = s.member.prompt_style if style == "auto" else style
        rows = {}
        for j, (p, g) in enumerate(zip(run.shards[_owner(s)], gs)):
            k = len(g.responses)
            rows[p] = (
                [extract_answer(r.text, read, batch[p].choices) for r in g.responses],
                [format_ok(r.text, s.member.prompt_style) for r in g.responses],
                [r.text for r in g.responses],
                [len(r.token_ids) for r in g.responses],
                scores[n]["entropy"][j].tolist() if scores else [0.0] * k,
                scores[n]["self_certainty"][j].tolist() if scores else [0.0] * k,
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
) -> dict:
    """Each hosted trainable member takes one optimizer step on its shard of all its slots' sequences
    (gradients summed over its ranks). An EMA teacher (co_rewarding_2) then moves toward its student.
    Returns {member id: update stats}."""
    cfg, updates = run.cfg, {}
    for m in run.members:
        if not m.cfg.trainable:
            continue
        mine = [n for n, s in enumerate(run.slots) if s.member is m]
        seqs = [
            seq
            for n in mine
            for seq in _sequences(
                groups[n], run.shards[m.id], advantages[run.slots[n].index], rewards[run.slots[n].index], cfg
            )
        ]
        trained = [n for n, spec in enumerate(run.specs) if spec.member_id == m.id and not spec.teacher]
        totals = batch_totals(
            [lengths[n] for n in trained], [rewards[n] for n in trained], cfg.algo.filter_zero_variance
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
    re-sync)."""
    synced = set()
    for s in run.slots:
        if id(s.engine) not in synced and (s.member.cfg.trainable or s.follows is not None):
            s.engine.sync_weights()
            synced.add(id(s.engine))


def batch_totals(
    lengths: list[list[list[int]]], rewards: list[torch.Tensor], filter_zero_variance: bool
) -> tuple[int, int]:
    """(response tokens, responses) a member trains on over the whole batch, all its ranks and slots: the
    loss normaliser, so that the ranks' shares add up to the full-batch loss. lengths, rewards: (B, K) each."""
    tokens = seqs = 0
    for lens, r in zip(lengths, rewards):
        keep = nonzero_variance_groups(r) if filter_zero_variance else torch.ones(len(lens), dtype=torch.bool)
        tokens += sum(sum(row) for row, k in zip(lens, keep.tolist()) if k)
        seqs += sum(len(row) for row, k in zip(lens, keep.tolist()) if k)
    return tokens, seqs


def _sequences(groups, positions: range, advantages: torch.Tensor, rewards: torch.Tensor, cfg) -> list[Sequence]:
    """One slot's sequences at its batch `positions` (those of zero-variance groups marked untrained when
    algo.filter_zero_variance). advantages, rewards: (B, K) over the whole batch."""
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
            trained=bool(keep[p]),
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
        required[model_id] = required_files(trainable=cfg_of.trainable and not spec.teacher)
        if run.cfg.train.deepspeed and cfg_of.trainable and not spec.teacher:  # one optimizer partition per rank
            required[model_id] = required[model_id][:-1] + state_files(len(run.placement[spec.member_id]))
    state = {"sampler": run.sampler.state_dict(), "members": required, "rows": rows, "replicas": replicas}
    save_checkpoint(run.world, run.run_dir, step, [(m, writers[m.id]) for m in models], state, run.cfg.train.keep_last)


def _check_replicas(run: CohortRun, models) -> dict[str, dict[int, float]]:
    """Every rank of a member must hold the same weights (data parallel keeps them so); a divergence is a
    bug that would silently corrupt the saved member, so it stops the run."""
    sums: dict[str, dict[int, float]] = {}
    for rank, part in enumerate(
        run.world.all_gather({m.id: weights_checksum(t for _, t in m.full_weights()) for m in models})
    ):
        for mid, value in part.items():
            sums.setdefault(mid, {})[rank] = value
    diverged = {mid: by_rank for mid, by_rank in sums.items() if len(set(by_rank.values())) > 1}
    if diverged:
        raise RuntimeError(f"the ranks of a member hold different weights: {diverged}")
    return sums  # {model id: {rank: checksum}}, recorded in the checkpoint's manifest


def _owner(slot: Slot) -> str:
    """The member whose ranks host `slot` (a teacher lives with its student)."""
    return slot.follows.id if slot.follows is not None else slot.member.id


def _gather_step_facts(world: World, updates: dict, rollout_s: dict) -> tuple[dict, dict]:
    """Every member's update stats (from its first rank; identical on the others) and each slot's rollout
    seconds (the slowest of its ranks), on every rank."""
    updates_all, seconds = {}, {}
    for part in world.all_gather((updates, rollout_s)):
        for mid, stats in part[0].items():
            updates_all.setdefault(mid, stats)
        for sid, sec in part[1].items():
            seconds[sid] = max(seconds.get(sid, 0.0), sec)
    return updates_all, seconds


def load_training_examples(spec: DatasetConfig) -> tuple[list, object]:
    """The training examples of a `DatasetConfig` (`skip` first ones dropped, then at most `limit`) and the
    loader's report of the records it kept and skipped (by reason)."""
    stop = spec.skip + spec.limit if spec.limit else None
    data = load_examples(spec.loader, spec.path, split=spec.split, limit=stop, **spec.options)
    log.info("data: %s", data.report.summary())
    kept = data.examples[spec.skip :]
    if not kept:
        raise DataError(
            f"data.train: no training examples left ({len(data.examples)} loaded, skip={spec.skip}; "
            f"{data.report.summary()}): check data.train.path, split, skip and limit"
        )
    return kept, data.report


def evaluate_cohort(run: CohortRun, eval_cfg: EvalConfig, step: int) -> list[dict]:
    """The eval hook: every member on every configured benchmark, by the member's first rank (one row per
    member and benchmark, gathered on every rank)."""
    rows = []
    for name in eval_cfg.benchmarks:
        bench = BENCHMARKS.get(name)
        if eval_cfg.max_new_tokens:
            bench = replace(bench, max_new_tokens=eval_cfg.max_new_tokens)
        bench = replace(bench, temperature=eval_cfg.temperature)
        examples = benchmark_examples(bench, eval_cfg.limit)
        for m in run.members:
            if run.world.rank != run.placement[m.id][0]:
                continue
            engine, room = _eval_engine(run, m, bench)
            result = evaluate_member(m, examples, bench, engine=engine, max_prompt_tokens=room)
            counts = Counter(r["type"] for r in result["records"] if r["type"] is not None)
            rows.append(
                {
                    "step": step,
                    "member": m.id,
                    "benchmark": bench.name,
                    "score": result["score"],
                    "accuracy": result["accuracy"],
                    "n": result["n"],
                    **{f"accuracy_{t}": a for t, a in result["by_type"].items()},
                    **{f"n_{t}": counts[t] for t in result["by_type"]},
                }
            )
    return [row for part in run.world.all_gather(rows) for row in part]


def _eval_engine(run: CohortRun, member, bench):
    """(engine, longest prompt) for an in-loop evaluation: the member's own vLLM rollout engine (synced after
    every update; a partitioned ZeRO-3 member has no module the HF engine could run) with what its sequence
    length leaves after the benchmark's answer, or the HF engine (None: evaluate_member's default)."""
    r = run.cfg.rollout
    if r.engine != "vllm":
        return None, 1 << 30
    return next(
        s.engine for s in run.slots if s.member is member
    ), r.max_prompt_tokens + r.max_new_tokens - bench.max_new_tokens


RUN_FILES = ("metrics.jsonl", "eval.jsonl", "summary.json", "config.yaml", "checkpoints", "tensorboard", BEST_DIR)


def _claim_run_dir(cfg: CohortConfig, run_dir: Path, clear: bool) -> None:
    """A fresh run needs a run directory without another run in it: appending to its metrics and pruning its
    checkpoints would mix two runs. With train.overwrite the old run's files are removed (by `clear`: rank 0)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"output_dir={str(run_dir)!r} is a file; choose a directory"], ["output_dir"])
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not found or found == ["config.yaml"]:
        return
    if not cfg.train.overwrite:
        go_on = "continue it with train.resume=true, " if latest_checkpoint(run_dir) else ""
        raise ConfigError(
            [
                f"output_dir={str(run_dir)!r} already holds a run ({', '.join(found)}): {go_on}replace it "
                "with train.overwrite=true, or choose another output_dir"
            ],
            ["output_dir"],
        )
    if clear:
        log.warning("train.overwrite=true: removing the run in %s (%s)", run_dir, ", ".join(found))
        for name in found:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _resume_point(cfg: CohortConfig, run_dir: Path) -> Path | None:
    if cfg.train.resume is False:
        return None
    found = latest_checkpoint(run_dir, warn=True)
    if found is None and cfg.train.resume is True:
        raise ConfigError(
            [
                f"train.resume=true but {run_dir}/checkpoints holds no complete checkpoint: use "
                "train.resume=auto to start fresh when there is none"
            ],
            ["train.resume"],
        )
    return found


@dataclass
class StepOutcome:
    """What one step leaves for its metrics rows: the cohort batch and its rewards, the gold answers and
    categories of its questions (diagnostics only), response lengths, update stats and rollout seconds."""

    step: int
    cohort: CohortBatch
    scored: object  # vlm_corl.training.rewards.RewardOutput
    gold: list
    categories: list  # (B,) str | None
    lengths: list  # (N, B, K)
    updates: dict  # member id -> update stats
    rollout_s: dict  # slot id -> seconds


def metrics_rows(run: CohortRun, o: StepOutcome) -> tuple[list[dict], list[dict]]:
    """One metrics row per slot (per member, in the usual layout), update stats on the member's first slot;
    and the collapse warnings first raised by these rows.

    Cohort-level diagnostics (unanimity) are the same in every row. With logging.category_key, each row also
    holds the step's per-category sums and their running means over logging.category_window steps
    (vlm_corl.training.category_metrics). The collapse detector runs on the earlier rows (`run.history`) plus these,
    sets `collapse_flag`/`collapse_on` and logs a slot's first detections (vlm_corl.training.collapse)."""
    rows, reported = [], set()
    unanimous = cohort_unanimity(o.cohort, o.gold, run.cfg.reward.vote_threshold)
    shared = unanimity(unanimous)
    window = run.cfg.logging.category_window
    recent = run.history[-(window - 1) * len(run.specs) :] if window > 1 else []
    for n, s in enumerate(run.specs):
        row = {"step": o.step, "member": s.id}
        row.update(member_metrics(n, o.cohort, o.scored, o.lengths[n], o.gold))
        row.update(shared)
        if any(c is not None for c in o.categories):
            row["category_stats"] = category_step_stats(n, o.cohort, o.scored, o.categories, o.gold, unanimous)
            mine = [r.get("category_stats") for r in recent if r["member"] == s.id]
            row.update(window_metrics(mine + [row["category_stats"]]))
        stats = o.updates.get(s.member_id, {}) if s.member_id not in reported else {}
        reported.add(s.member_id)
        row.update({k: stats.get(k) for k in ("loss", "grad_norm", "lr")})
        row.update({k: v for k, v in stats.items() if k.startswith("is_")})  # algo.rollout_is mismatch
        row["tokens_per_s"] = sum(map(sum, o.lengths[n])) / o.rollout_s[s.id]
        rows.append(row)
    return rows, flag_step(run.history, rows)


def environment(world: World) -> dict:
    """What a result depends on beyond the config: library versions, torch threads, processes, git commit."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "vllm"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                text=True,
                capture_output=True,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "torch_threads": torch.get_num_threads(),
        "processes": world.size,
        "device": str(world.device),
        "versions": versions,
        "git_commit": commit,
    }


def _summary(cfg, history: list[dict], run_dir: Path, view_fallbacks: dict[str, int]) -> dict:
    last = {}
    for row in history:
        last[row["member"]] = row
    newest = latest_checkpoint(run_dir)
    return {
        "run_dir": str(run_dir),
        "steps": cfg.train.max_steps,
        "reward_mode": cfg.reward.custom or cfg.reward.mode,
        "members": {
            mid: {k: row.get(k) for k in ("reward_mean", "agreement", "pseudo_label_acc", "answer_acc")}
            for mid, row in last.items()
        },
        "view_fallbacks": view_fallbacks,
        # each slot's first detection of "diversity falls while agreement rises" (vlm_corl.training.collapse)
        "collapse_warnings": collapse_warnings(history),
        "checkpoint": str(newest) if newest else None,
    }

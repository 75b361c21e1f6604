"""A run's set-up: join the launch, place the members, load the data and this process's members, build their
slots, and restore the newest checkpoint when resuming. `start_run` returns the `CohortRun` the step loop
(`vlm_corl.training.loop`) works on; the run directory's files at the end are `vlm_corl.training.run.summary`'s.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from vlm_corl.cli import output_dir
from vlm_corl.config import CohortConfig, ConfigError, save_config
from vlm_corl.config.engine_layout import engine_layout_problems, member_engine
from vlm_corl.config.loading import config_to_dict, config_warnings
from vlm_corl.config.resume_rules import changed_at_resume
from vlm_corl.config.schema import DatasetConfig, resolve_async
from vlm_corl.data.loaders import DataError, load_examples, loader_category
from vlm_corl.data.paraphrases import apply_paraphrases, read_cache
from vlm_corl.data.records import Example
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.distributed.world import World, build_groups, describe, launch_world, place_members, shard
from vlm_corl.errors import UserError
from vlm_corl.members.deepspeed_update import GroupMPU, attach_deepspeed, zero_stage
from vlm_corl.members.member import MemberLoadError, check_modality, load_member, member_family
from vlm_corl.members.state_files import corrupt_file
from vlm_corl.planning.check import check_disk, check_launch, resolve_micro_batch, write_plan
from vlm_corl.training.monitor.collapse import CollapseTracker
from vlm_corl.training.monitor.metrics import MetricsSink
from vlm_corl.training.monitor.throughput import Throughput
from vlm_corl.training.monitor.trackers import start_trackers
from vlm_corl.training.rewards.modes import RewardSpec, resolve_reward
from vlm_corl.training.rewards.reward_funcs import RewardFunction, check_run_columns
from vlm_corl.training.run.async_checkpoint import BackgroundCheckpoints
from vlm_corl.training.run.checkpoint import (
    check_resumed_data,
    data_fingerprint,
    latest_checkpoint,
    load_cohort_state,
    record_data,
    restore_rng,
)
from vlm_corl.training.run.guard import BEST_DIR, read_best
from vlm_corl.training.run.numerics import NonFiniteTracker
from vlm_corl.training.run.slots import Slot, SlotSpec, build_slots, check_views, slot_specs

log = logging.getLogger("vlm_corl")


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
    slots: list[Slot]  # the slots this process hosts (vlm_corl.training.run.slots)
    shards: dict[str, range]  # member id -> the batch positions this process rolls out and trains on
    sink: MetricsSink | None  # world rank 0 only
    reward_spec: RewardSpec
    start: int
    collapse: CollapseTracker  # the collapse detector over the run so far (restored from metrics.jsonl; rank 0)
    data_report: object = None  # vlm_corl.data.loaders.LoadReport: records kept and skipped (into summary.json)
    eval_history: list[dict] = field(default_factory=list)  # in-loop evaluation rows so far (rank 0)
    best: dict = field(default_factory=dict)  # member id -> {step, benchmark, score} of its kept best model
    too_long: dict = field(default_factory=dict)  # example id -> {member, tokens}: skipped, prompt too long
    category_key: str | None = None  # logging.category_key resolved (`category_key`): per-category metrics
    plan: object = None  # vlm_corl.planning.cohort.CohortPlan of this launch (None: train.check_memory off)
    nonfinite: NonFiniteTracker | None = None  # the numerical guard's skip counts (vlm_corl.training.run.numerics)
    updates: dict = field(default_factory=dict)  # the last step's update stats of every member, on every rank
    callbacks: object = None  # the user's callbacks (vlm_corl.training.run.callbacks.Callbacks), set by run_cohort
    reward_funcs: list = field(
        default_factory=list
    )  # reward functions (vlm_corl.training.rewards.reward_funcs), likewise
    prompt_styles: dict = field(default_factory=dict)  # member id -> its answer instruction (render.PROMPT_STYLES)
    data: dict = field(default_factory=dict)  # the training data by content (checkpoint.data_fingerprint)
    checkpoints: BackgroundCheckpoints | None = None  # train.async_checkpoint on: the writes in the background
    throughput: Throughput | None = None  # the speed fields of metrics rows (set when the steps start)


def start_run(cfg: CohortConfig, reward_funcs: Sequence[RewardFunction] = (), warn_config: bool = True) -> CohortRun:
    """Join the launch, place members on ranks, load data (and check `reward_funcs` against its columns) and this
    process's members, build their slots (engines, renderers), and restore the newest checkpoint if resuming.
    `warn_config`: log the config's warnings (`config_warnings`); false for preflight's shrunken copy of a config,
    whose changed settings are not the user's (preflight warns of the user's own)."""
    world, placement, reward_spec, cfg, plan = _join_launch(cfg)
    run_dir = Path(cfg.output_dir)
    resume_from, state = _resume_or_claim(cfg, run_dir, world)
    check_disk(cfg, world, plan)  # output_dir (writable, cleared if overwritten) holds the checkpoints to come
    examples, data_report = _load_data(cfg, resume_from, world)
    check_run_columns(reward_funcs, examples, log_it=world.is_main)  # before any model loads, not at step 1
    data = data_fingerprint(examples, cfg.data.train)  # the data by content: a resume on other data is refused
    if state is not None:
        check_resumed_data(state, run_dir, resume_from, data)  # before anything of the run is rewritten
    world.barrier()  # every rank has looked at the run directory before anything new is written
    if world.is_main:
        _write_run_files(cfg, run_dir, data, plan, f"over {world.size} process(es): {describe(placement)}", warn_config)
    torch.manual_seed(cfg.seed)
    sampler = LockstepSampler(len(examples), cfg.data.batch_size, cfg.data.seed, cfg.data.shuffle)
    specs = slot_specs(cfg.members, reward_spec.layout)
    lacking = check_views(examples, specs, cfg.data.view_fallback)
    if lacking and world.is_main:
        log.warning("examples without a slot's view, rendered in the original wording: %s", lacking)
    _check_shards(cfg, placement)
    members = load_hosted_members(cfg, world, placement, resume_from)
    slots = build_slots(cfg, members, specs, max(len(ex.images) for ex in examples), resume_from)
    gc.unfreeze()  # vLLM's engine froze the heap when built (gc.freeze): the run's objects would never be collected
    shards = {m.id: shard(cfg.data.batch_size, placement[m.id], world.rank) for m in members}
    sink = _metrics_sink(cfg, run_dir) if world.is_main else None
    start, history, eval_history = _restore(state, sampler, world, sink)
    collapse = CollapseTracker(recent=cfg.logging.category_window - 1)
    collapse.restore(history)  # the rows themselves are not kept: a long run's memory stays flat
    nonfinite = NonFiniteTracker(cfg.train.max_nonfinite_steps)
    nonfinite.restore(history)
    if state is not None:
        log.info("resumed from %s (step %d)", resume_from, start)
    # fmt: off
    return CohortRun(cfg, run_dir, world, placement, examples, sampler, members, specs, slots, shards, sink,
                     reward_spec, start, collapse, data_report, eval_history, read_best(run_dir),
                     category_key=category_key(cfg, examples, log_it=world.is_main), plan=plan,
                     nonfinite=nonfinite, prompt_styles=_prompt_styles(cfg, resume_from), data=data,
                     checkpoints=background_checkpoints(cfg, world))
    # fmt: on


def _join_launch(cfg: CohortConfig) -> tuple[World, dict, RewardSpec, CohortConfig, object]:
    """The launch joined and checked before anything is loaded: (world, placement, reward, the config with
    train.micro_batch_size resolved, the memory plan or None), every rank stopping alike on a bad layout."""
    world = launch_world(cfg.train.dist_timeout_s, need_group=cfg.train.deepspeed is not None)
    placement = place_members(cfg.members, world.size)
    reward_spec = resolve_reward(cfg.reward)
    _check_engine_layout(cfg, placement, reward_spec)  # before any collective that a bad layout would hang
    cfg = resolve_micro_batch(cfg, world.device, world.size, world.is_main)  # train.micro_batch_size: auto
    plan = check_launch(cfg, world.device, world.size, world.is_main)  # every rank: all stop alike
    build_groups(world, placement, every=cfg.train.deepspeed is not None)
    return world, placement, reward_spec, cfg, plan


def _resume_or_claim(cfg: CohortConfig, run_dir: Path, world: World) -> tuple[Path | None, dict | None]:
    """(the checkpoint to resume from and its cohort state, checked against the config), or (None, None) with
    the run directory claimed for a new run (cleared on world rank 0 where train.overwrite says so)."""
    resume_from = _resume_point(cfg, run_dir)
    state = load_cohort_state(resume_from) if resume_from else None
    if state is not None:
        _check_resumed_config(state, cfg, resume_from)
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
    return resume_from, state


def _write_run_files(cfg: CohortConfig, run_dir: Path, data: dict, plan, placement: str, warn: bool) -> None:
    """World rank 0: the run's config.yaml, its data's fingerprint and memory plan, and the placement and (with
    `warn`) config warnings in the log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    record_data(run_dir, data)
    if plan is not None:
        write_plan(plan, run_dir)
    log.info("placement %s", placement)
    for warning in config_warnings(cfg) if warn else ():
        log.warning(warning)


def _metrics_sink(cfg: CohortConfig, run_dir: Path) -> MetricsSink:
    """World rank 0's metrics files and the trackers of logging.report_to."""
    started = start_trackers(
        cfg.logging.report_to, run_dir, config_to_dict(cfg), cfg.name, cfg.logging.tracker_timeout_s
    )
    return MetricsSink(run_dir, started)


def _prompt_styles(cfg: CohortConfig, resume_from: Path | None) -> dict[str, str]:
    """Each member's answer instruction: its configured prompt_style, else its family's."""
    return {
        m.id: m.prompt_style or member_family(m, resume_from / m.id if resume_from else m.model).prompt_style
        for m in cfg.members
    }


def background_checkpoints(cfg: CohortConfig, world: World) -> BackgroundCheckpoints | None:
    """The run's background checkpoint writer where `train.async_checkpoint` resolves on (`resolve_async`)."""
    deepspeed = cfg.train.deepspeed is not None
    if deepspeed and cfg.train.async_checkpoint is True and world.is_main:
        log.warning("train.async_checkpoint: DeepSpeed writes its own state: checkpoints are taken at the step")
    if not resolve_async(cfg.train.async_checkpoint, world.device.type, deepspeed):
        return None
    if world.is_main:
        log.info("checkpoints are written in the background (train.async_checkpoint)")
    return BackgroundCheckpoints(world, Path(cfg.output_dir), cfg.train.keep_last)


def category_key(cfg: CohortConfig, examples: list[Example], log_it: bool = False) -> str | None:
    """The metadata key the run's per-category metrics and collapse detector use: `logging.category_key`, where
    "auto" is the key the training loader declares (`vlm_corl.data.loaders.declares_category`: easy-vqa's
    question_type, MATH's subject) when every example carries it, else none."""
    key = cfg.logging.category_key
    if key != "auto":
        return key
    declared = loader_category(cfg.data.train.loader)
    if declared is None or not all(declared in ex.metadata for ex in examples):
        return None
    if log_it:
        log.info("per-category metrics and collapse detection by %r (logging.category_key: auto)", declared)
    return declared


def _check_engine_layout(cfg: CohortConfig, placement: dict[str, tuple[int, ...]], reward_spec: RewardSpec) -> None:
    """The vLLM engine layout of this launch (vlm_corl.config.engine_layout), and vLLM itself where a member
    uses it: a ConfigError (exit 2) naming the ranks or members, not a hang at the first engine or an import
    error after the models loaded."""
    problems = engine_layout_problems(cfg, placement, teachers=reward_spec.layout == "ema_teacher")
    if importlib.util.find_spec("vllm") is None:  # before any model loads, not after the first one
        problems += [
            (
                f"members[{i}].engine" if m.engine else "rollout.engine",
                f"member {m.id!r} rolls out with vLLM, which is not installed here: pip install -e '.[vllm]' on a "
                "CUDA machine (docs/vllm.md), or set engine: hf",
            )
            for i, m in enumerate(cfg.members)
            if member_engine(cfg, m) == "vllm"
        ]
    if problems:
        raise ConfigError([f"{path}: {message}" for path, message in problems], [path for path, _ in problems])


def _load_data(cfg: CohortConfig, resume_from: Path | None, world: World) -> tuple[list[Example], object]:
    """The training examples (with their paraphrases, when configured) and the loader's report, after checking
    that every member can read them. World rank 0 loads first, filling the picture check cache
    (`vlm_corl.data.image_checks`) that the other ranks then read; a rank that cannot see it checks for itself."""
    if not world.is_main:
        world.barrier()
    try:
        examples, data_report = load_training_examples(cfg.data.train)
    finally:  # rank 0 releases the others on a data error too: each then meets the same error itself
        if world.is_main:
            world.barrier()
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
        # Killed between the checkpoint and the metrics write, or mid-write (one member's row whole, the next
        # torn and dropped): every row of the checkpoint's step that did not survive comes from the checkpoint.
        kept = {row["member"] for row in history if row["step"] == start}
        missing = [row for row in state.get("rows", []) if row["member"] not in kept]
        sink.write(missing)
        history += missing
    return start, history, eval_history


def load_hosted_members(cfg: CohortConfig, world: World, placement: dict, resume_from: Path | None) -> list:
    """The members placed on this rank, loaded (from the checkpoint when resuming) with their group, and the
    trainable ones with their optimizer and schedule (restored when resuming), DeepSpeed engine and KL anchor.

    Every trainer state exists before any rollout engine is built (`build_slots`): vLLM measures the memory
    left with the weights, gradients and Adam moments already there. ZeRO-3 members load on the host and are
    partitioned onto the device (`attach_deepspeed`), never whole on one GPU."""
    zero3 = cfg.train.deepspeed is not None and zero_stage(cfg.train.deepspeed) == 3
    members = []
    for mc in (m for m in cfg.members if world.rank in placement[m.id]):
        source = resume_from / mc.id if resume_from else None
        try:
            m = load_member(mc, source, world.device, rollout=cfg.rollout.dtype, stage_on_cpu=zero3 and mc.trainable)
        except MemberLoadError as err:
            if source is None:
                raise
            raise corrupt_file(source, err) from err  # the checkpoint's copy of the member is damaged
        m.group = world.group(placement[m.id])
        members.append(m)
        if not m.cfg.trainable:
            continue
        updates = cfg.train.max_steps * cfg.algo.updates_per_batch  # the schedule spans every optimizer step
        if cfg.train.deepspeed:
            ranks = placement[m.id]
            hf = member_engine(cfg, mc) == "hf"
            mpu = GroupMPU(world.group(ranks), world.singles[world.rank])  # model parallel: this rank alone
            attach_deepspeed(m, cfg.train, updates, mpu, keep_full_copy=hf)
            if m.deepspeed.full_copy is not None and world.rank == ranks[0]:
                log.info(
                    "ZeRO-3 member %s keeps a full %s copy of its weights for HF rollouts (its engine vllm would "
                    "stream them instead)",
                    m.id,
                    str(m.rollout_dtype).removeprefix("torch."),
                )
        else:
            m.setup_optimizer(cfg.train, updates)
        if resume_from:
            m.load_trainer_state(resume_from / m.id)
        if cfg.algo.kl_beta > 0:  # the KL anchor is the member's initial model, also after a resume
            anchor = load_member(replace(m.cfg, trainable=False), device=world.device, rollout=cfg.rollout.dtype)
            m.reference = anchor.model.eval()
    return members


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
    families = [member_family(m, resume_from / m.id if resume_from else m.model) for m in cfg.members]
    for i, (m, family) in enumerate(zip(cfg.members, families)):
        check_modality(family, examples, f"members[{i}] ({m.id!r}, {m.model})")
    if all(f.modality == "vision" for f in families) and not any(ex.images for ex in examples):
        # text questions for vision members are legitimate, but data whose image column went unread looks alike
        log.warning(
            "no training example has an image, and every member reads images: the cohort trains on text alone; if "
            "the data has pictures, name their column (data.train.options fields={'images': ...}, or the Python "
            "API's columns={'image': ...})"
        )


def _check_shards(cfg: CohortConfig, placement: dict[str, tuple[int, ...]]) -> None:
    """Every rank of the widest member needs an example of each batch."""
    widest = max(len(r) for r in placement.values())
    if cfg.data.batch_size < widest:
        raise ConfigError(
            [
                f"data.batch_size={cfg.data.batch_size} is smaller than the {widest} ranks of a member: "
                "every rank needs at least one example per step; raise data.batch_size"
            ],
            ["data.batch_size"],
        )


def load_training_examples(spec: DatasetConfig) -> tuple[list, object]:
    """The training examples of a `DatasetConfig` (`skip` first ones dropped, then at most `limit`) and the
    loader's report of the records it kept and skipped (by reason)."""
    stop = spec.skip + spec.limit if spec.limit else None
    data = load_examples(spec.loader, spec.path, split=spec.split, limit=stop, **spec.options)
    kept = data.examples[spec.skip :]
    if not kept:
        raise DataError(
            f"data.train: no training examples left ({len(data.examples)} loaded, skip={spec.skip}; "
            f"{data.report.summary()}): check data.train.path, split, skip and limit"
        )
    data.report.skip_first, data.report.used = spec.skip, len(kept)  # what the run trains on, after skip/limit
    log.info("data: %s", data.report.summary())
    return kept, data.report


RUN_FILES = (
    "metrics.jsonl", "eval.jsonl", "samples.jsonl", "summary.json", "config.yaml", "checkpoints", "tensorboard",
    "wandb", "mlruns", "plan.json", BEST_DIR,
)  # fmt: skip


def _claim_run_dir(cfg: CohortConfig, run_dir: Path, clear: bool) -> None:
    """A fresh run needs a run directory without another run in it: appending to its metrics and pruning its
    checkpoints would mix two runs. With train.overwrite the old run's files are removed (by `clear`: rank 0)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError([f"output_dir={str(run_dir)!r} is a file; choose a directory"], ["output_dir"])
    try:  # before anything expensive: a directory that cannot be made or written (permissions, read-only disk)
        output_dir(run_dir, "output_dir")
    except UserError as err:
        raise ConfigError([str(err)], ["output_dir"]) from None
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not _held_run(found):
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


def _held_run(found: list[str]) -> bool:
    """Whether the RUN_FILES `found` in a run directory are a run's: only config.yaml and plan.json are a
    launch that stopped before its first step."""
    return not set(found) <= {"config.yaml", "plan.json"}


def _check_resumed_config(state: dict, cfg: CohortConfig, checkpoint: Path) -> None:
    """Refuse a resume whose config changes a field the checkpoint's meaning depends on (the rules and why:
    vlm_corl.config.resume_rules), naming each field with its value there and here; a checkpoint written
    before checkpoints kept their config is not checked."""
    if "config" not in state:
        log.warning("%s holds no config (written by an earlier version): the resumed config is not checked", checkpoint)
        return
    changed = changed_at_resume(state["config"], config_to_dict(cfg))
    if changed:
        raise ConfigError(
            [
                f"{path} changed since {checkpoint} was written ({old!r} there, {new!r} now): {why}. Put it back "
                "to resume, or start a new run (another output_dir, or train.overwrite=true)"
                for path, old, new, why in changed
            ],
            [path for path, *_ in changed],
        )


def _resume_point(cfg: CohortConfig, run_dir: Path) -> Path | None:
    if cfg.train.resume is False:
        return None
    found = latest_checkpoint(run_dir, warn=True)
    if found is None and cfg.train.resume is True:
        held = [name for name in RUN_FILES if (run_dir / name).exists()]
        start = (  # train.resume=auto would claim the directory and be refused for the run in it
            f"start it again with train.resume=false train.overwrite=true (this removes the run there: "
            f"{', '.join(held)}), or choose another output_dir"
            if _held_run(held)
            else "start it with train.resume=auto (a later launch resumes its newest checkpoint)"
        )
        raise ConfigError(
            [f"train.resume=true but {run_dir}/checkpoints holds no complete checkpoint: {start}"], ["train.resume"]
        )
    return found

"""`corl preflight`'s phases: a run's start and two steps of the loop's own phase functions on the user's node and
checkpoints, each phase timed and measured per rank, the first failure agreed by every rank and named (phase,
rank, member, the fix to try).

The steps are the loop's (`vlm_corl.training.loop`: render, rollout, extract, exchange, update with its sleep,
sync with its push and wake), on a batch cut to what one update micro-batch at the planned size needs, with two
differences that make them a test:
- the rewards are a fixed half-right pattern, not the reward mode's (a random or untrained cohort often agrees on
  nothing, and a group of equal rewards trains nothing): every response gets a non-zero advantage, so the update
  runs whole micro-batches;
- between the two steps each member's policy is moved far (`perturb`: noise on its output head, on the adapters
  of a LoRA member) before the push, and the second step's update measures the rollout guard's number (mean
  |log pi_train - log pi_rollout| per token of the engine's sampled tokens, `algo.rollout_is`'s `is_abs_dlogp`)
  and applies the guard itself (`check_rollout_mismatch`): a push that does not reach the engine leaves it
  sampling from the unmoved weights, several nats per token away.

The update runs two micro-batches per rank (a ZeRO-2 member accumulates its gradients over them), and each phase's
peak is compared with the plan of this small config (the user's plan is reported beside it, `run_plan`). A hang or
one rank's failure ends in the same verdict on every rank within the preflight's own time limit
(`vlm_corl.commands.preflight_watch`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from vlm_corl.commands.preflight_watch import (
    GRACE_S,
    PREFLIGHT_TIMEOUT_S,
    Agreement,
    Failure,
    PreflightFailed,
    Watchdog,
    nccl_environment,
)
from vlm_corl.config import CohortConfig
from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.loading import config_warnings
from vlm_corl.distributed.exchange import exchange
from vlm_corl.distributed.world import World, default_device, launch_world, place_members
from vlm_corl.errors import UserError
from vlm_corl.members.memory import GB
from vlm_corl.planning.check import check_disk, check_launch, held_bytes, launch_hardware, resolve_micro_batch, size
from vlm_corl.planning.cohort import CohortPlan, plan_cohort, with_changes
from vlm_corl.planning.disk import DiskPlan, checkpoint_disk
from vlm_corl.training.phases.phase_timer import PhaseTimer
from vlm_corl.training.phases.render_ahead import render_phase
from vlm_corl.training.phases.rollout_phase import extract_phase, rollout_phase
from vlm_corl.training.phases.update_phase import follow_students, sync_phase, update_phase
from vlm_corl.training.rewards.grpo import group_advantages
from vlm_corl.training.run.numerics import RolloutMismatchStopped, check_rollout_mismatch
from vlm_corl.training.run.release import giving_back, release_run
from vlm_corl.training.run.setup import CohortRun, start_run
from vlm_corl.training.run.slots import models_to_save

log = logging.getLogger("vlm_corl")

PUSH_LIMIT = 1.0  # nats per token: the guard's default (algo.rollout_is_max_abs_dlogp) when the config's is 0
HEAD_NOISE = 3.0  # output-head noise std x sqrt(hidden): an RMS-normalised hidden state has norm ~sqrt(hidden), so
# every logit moves by ~3 nats, and an engine that kept the old head samples tokens several nats per token away
OVER_PLAN = 1.10  # a measured phase peak this far over the plan's is a warning: the plan under-counts this node
MEASURED_PHASES = ("rollout", "update", "sync", "rollout_after_push", "update_after_push")
PLAN_OF_PHASE = {"rollout": "rollout", "rollout_after_push": "rollout", "update": "update",
                 "update_after_push": "update", "sync": "resident"}  # fmt: skip
MICRO_BATCHES = 2  # per rank in each update: a ZeRO-2 member's second gradient partition during accumulation


@dataclass
class PreflightOptions:
    """What `corl preflight`'s command line sets beside the config: the rollouts' length cap, the timed
    all-reduce's MB, the time limit (each phase's deadline and the collectives' timeout, not
    train.dist_timeout_s), and where preflight.json goes (None: nowhere; the ranks after 0 write their part
    beside it, preflight.rank1.json ...)."""

    max_new_tokens: int | None = None
    collective_mb: int | None = None
    timeout_s: float = PREFLIGHT_TIMEOUT_S
    out: Path | None = None


def classify(err: BaseException, phase: str) -> tuple[str, int]:
    """(the fix to try, the exit status) of an exception raised in `phase`."""
    if isinstance(err, RolloutMismatchStopped):
        return (
            "the engine does not serve the weights the trainer pushed: with vLLM sleep mode on, try "
            "rollout.vllm.sleep_level: 1 (the engine keeps its weights through the update); else "
            "members[i].engine: hf; report it with preflight.json",
            3,
        )
    if isinstance(err, torch.OutOfMemoryError):
        return (
            f"this rank ran out of device memory in the {phase} phase: lower train.micro_batch_size (update) or "
            "rollout.vllm.gpu_memory_utilization / rollout.n (rollout), or place the member on more ranks; "
            "`corl plan --config FILE --suggest` proposes a layout that fits",
            2,
        )
    if isinstance(err, UserError):
        return "as the message says (it names the field or file to change)", 2
    return (
        "a fault of this node's install or of the trainer: rerun with --debug for the traceback and report it with "
        "preflight.json and the versions above",
        3,
    )


@dataclass
class RankReport:
    """What one rank measured: each phase's seconds and peak memory (GB; CUDA: the allocator's peak in the phase,
    else the process's largest resident set so far), the plan's bytes for it, the collectives' seconds."""

    rank: int
    members: list[str]
    peak_source: str
    phases: dict = field(default_factory=dict)  # name -> {seconds, peak_gb, plan_gb}
    collectives: dict = field(default_factory=dict)  # name -> {seconds, mb, gb_per_s}


class Preflight:
    """Named phases over every rank: `with pf.phase(name, member)` runs one under its deadline, records its
    seconds and peak and any exception (with the member it concerns), then every rank learns through the store
    whether some rank failed and, if so, all raise the same `PreflightFailed` (the first published), so no rank
    waits in a collective the others left. `end` writes this rank's report, whoever ends the rank."""

    def __init__(self, world: World, report: dict, options: PreflightOptions):
        self.world, self.plan, self.report, self.options = world, None, report, options
        self.timer = PhaseTimer(world, 0)
        cuda = world.device.type == "cuda"
        self.rank = RankReport(world.rank, [], "cuda_allocator" if cuda else "process_rss")
        self.began, self.run = time.perf_counter(), None
        self.agreement = Agreement(world)
        self.watchdog = Watchdog(self.agreement, options.timeout_s, self._stopped)

    @contextmanager
    def phase(self, name: str, member: str | None = None):
        """Run the body as phase `name` (of `member`, when one member's), then agree over the ranks."""
        failure = None
        start = time.perf_counter()
        self.watchdog.arm(name, member or ", ".join(self.rank.members) or None)
        try:
            with self.timer(name):
                yield
        except PreflightFailed:
            raise
        except Exception as err:  # noqa: BLE001 - every rank must learn of it before the next collective
            fix, status = classify(err, name)
            who = getattr(err, "preflight_member", None) or member or ", ".join(self.rank.members) or None
            failure = Failure(name, self.world.rank, who, f"{type(err).__name__}: {err}"[:2000], fix, status)
            log.debug("preflight: %s failed on rank %d:\n%s", name, self.world.rank, traceback.format_exc())
        self.rank.phases[name] = {"seconds": round(time.perf_counter() - start, 3), **self._peak(name)}
        verdict = self.agreement.arrive(name, failure)
        self.watchdog.disarm()
        if verdict is not None:
            raise PreflightFailed(verdict)

    def _stopped(self, failure: Failure, stacks: str | None) -> None:
        """The watchdog's end of this rank: the verdict and this rank's threads' stacks (hang) in its report."""
        self.report.update(
            verdict="failed", failure=asdict(failure), watchdog={"rank": self.world.rank, "stacks": stacks}
        )
        self.end()

    def end(self) -> dict:
        """This rank's end: its phases shared in the store; rank 0 merges every rank's it finds (all of them
        after `ready`; within a few GRACE_S after a failure, a hung rank's never) and writes preflight.json, the
        other ranks their own part beside it; then it waits (at most the time limit) until every rank has ended:
        a launcher kills the others when the first process exits."""
        report, world, own = self.report, self.world, asdict(self.rank)
        self.agreement.share("rank", own)
        wait = (self.options.timeout_s if report["verdict"] == "ready" else 3 * GRACE_S) if world.is_main else 0
        parts = self.agreement.collect("rank", own, wait)
        report["ranks"] = [parts[r] for r in sorted(parts)]
        report["missing_ranks"] = [r for r in range(world.size) if r not in parts] if world.is_main else []
        report["warnings"] += _peak_warnings(report["ranks"])
        report["seconds"] = round(time.perf_counter() - self.began, 1)
        unwritten = write_report(report, self.options.out, world.rank)
        if unwritten:  # after the write: the verdict is still printed, with why the file is not there
            report["unwritten"] = unwritten
        self.agreement.share("ended", True)
        self.agreement.collect("ended", True, self.options.timeout_s)
        return report

    def _peak(self, name: str) -> dict:
        if self.world.device.type == "cuda":
            peak = self.timer.peaks.get(name)
        else:  # ru_maxrss: KB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        out = {"peak_gb": None if peak is None else round(peak, 3)}
        if self.plan is not None and name in PLAN_OF_PHASE and self.world.rank < len(self.plan.ranks):
            out["plan_gb"] = round(self.plan.ranks[self.world.rank].phase_bytes(PLAN_OF_PHASE[name]) / GB, 3)
        return out


def preflight_config(cfg: CohortConfig, world_size: int, max_new_tokens: int | None, work: Path) -> CohortConfig:
    """The config the preflight's two steps run: the user's members, engines, data, DeepSpeed and micro-batch
    (resolved), a batch of the fewest prompts that fill MICRO_BATCHES update micro-batches on each member's ranks
    (fewer where data.batch_size is smaller), two steps,
    its own work directory (on output_dir's disk) and nothing written there but what start_run writes, the rollout
    guard's measurement on (algo.rollout_is), no plan or disk check (done on the user's config already)."""
    widest = max(len(ranks) for ranks in place_members(cfg.members, world_size).values())
    k = cfg.rollout.n
    per_rank = max(1, math.ceil(MICRO_BATCHES * int(cfg.train.micro_batch_size) / k))
    batch = min(cfg.data.batch_size, max(2, widest * per_rank))
    changes = {
        "output_dir": str(work),
        "data.batch_size": max(batch, widest),
        "train.max_steps": 2,
        "train.save_every": 0,
        "train.save_last": False,
        "train.resume": False,
        "train.overwrite": True,
        "train.check_memory": "off",
        "train.async_checkpoint": False,
        "eval.every": 0,
        "logging.report_to": [],
        "logging.progress": False,
        "logging.samples_every": 0,
    }
    if cfg.algo.rollout_is == "none":  # its statistics are the guard's number; the loss changes, which is fine here
        changes["algo.rollout_is"] = "token_truncated"
    if max_new_tokens is not None:
        changes["rollout.max_new_tokens"] = min(cfg.rollout.max_new_tokens, max_new_tokens)
    return with_changes(cfg, changes)


def plan_phase(cfg: CohortConfig, world: World) -> tuple[CohortConfig, CohortPlan | None]:
    """The user's config with its micro-batch resolved, and its plan: a plan that does not fit, or a disk that
    cannot hold the run's checkpoints, raises (ConfigError / DiskTooSmall) as train would with
    train.check_memory: error, whatever the config's mode (off: no plan, nothing checked)."""
    cfg = resolve_micro_batch(cfg, world.device, world.size, world.is_main)
    if cfg.train.check_memory == "off":
        return cfg, None
    strict = with_changes(cfg, {"train.check_memory": "error"})
    plan = check_launch(strict, world.device, world.size, world.is_main)
    check_disk(strict, world, plan)
    return cfg, plan


def half_right(lengths: list[list[list[int]]]) -> torch.Tensor:
    """(N, B, K) rewards: responses alternate 1, 0 within each group, so every group has two values and every
    response a non-zero advantage (the update trains every sequence)."""
    n, b, k = len(lengths), len(lengths[0]), len(lengths[0][0])
    return (torch.arange(k) % 2 == 0).float().expand(n, b, k).clone()


def tag_engines(run: CohortRun) -> None:
    """Each engine's calls name their member on an exception (`preflight_member`): a rank hosting several members
    says which one failed."""
    for s in run.slots:
        engine = s.engine
        if getattr(engine, "_preflight_tagged", False):
            continue
        for name in ("generate", "sleep", "sync_weights", "wake"):
            setattr(engine, name, _tagged(getattr(engine, name), s.member.id))
        engine._preflight_tagged = True


def _tagged(fn, member_id: str):
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if getattr(err, "preflight_member", None) is None:
                err.preflight_member = member_id
            raise

    return call


@torch.no_grad()
def perturb(member, seed: int = 0) -> str:
    """Move `member`'s policy far, the same way on each of its ranks: noise on its output head (tied to the input
    embeddings where the model ties them: the push must carry that too), or on a LoRA member's adapter B matrices
    (what its push carries). Returns what was moved."""
    if member.peft is not None:
        scaling = max(member.lora_scaling.values(), default=1.0)  # alpha / r, the same for every layer
        tensors = [p for n, p in member.model.named_parameters() if "lora_B" in n]
        r = getattr(tensors[0], "ds_shape", tensors[0].shape)[1] if tensors else 1  # ZeRO-3: the whole shape
        std = 1.0 / (scaling * math.sqrt(r))  # B A x moves each output by ~its own scale
        what = f"{len(tensors)} LoRA B matrices"
    else:
        head = member.model.get_output_embeddings().weight
        tensors, what = [head], "the output head"
        hidden = getattr(head, "ds_shape", head.shape)[-1]
        std = HEAD_NOISE / math.sqrt(hidden)
    for i, w in enumerate(tensors):
        with _gathered(member, w):
            gen = torch.Generator(device=w.device).manual_seed(seed + i)
            w.add_(torch.randn(w.shape, generator=gen, device=w.device, dtype=torch.float32).to(w.dtype), alpha=std)
            moved = w.double().abs().sum().item()
        with _gathered(member, w, write=False):  # what the module holds now, not the gathered copy written above
            held = w.double().abs().sum().item()
        if not math.isclose(held, moved, rel_tol=1e-6):  # else the push check would test an unmoved policy
            raise RuntimeError(f"member {member.id!r}: the preflight's change to {what} did not persist")
    return what


@contextmanager
def _gathered(member, w: torch.Tensor, write: bool = True):
    """`w` whole for the body; under ZeRO-3 gathered over the member's ranks, and with `write` what the first of
    them wrote partitioned again (each rank draws the same noise, so any would do)."""
    if not member.partitioned:
        yield
        return
    import deepspeed
    import torch.distributed as dist

    first = min(dist.get_process_group_ranks(w.ds_process_group)) if dist.is_initialized() else 0
    with deepspeed.zero.GatheredParameters([w], modifier_rank=first if write else None):
        yield


def collectives(run: CohortRun, mb: int) -> dict:
    """One timed all-reduce of `mb` MB over each member group this rank is in (what a member's update sums its
    gradients with); {group name: {seconds, mb, gb_per_s}}."""
    import torch.distributed as dist

    out = {}
    for mid, ranks in sorted(run.placement.items()):
        group = run.world.group(ranks)
        if group is None or run.world.rank not in ranks or ranks in [tuple(v["ranks"]) for v in out.values()]:
            continue
        buf = torch.ones(mb * 2**18, device=run.world.device)  # fp32: 4 bytes each
        _sync(run.world)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        _sync(run.world)
        seconds = time.perf_counter() - start
        out[f"all_reduce:{mid}"] = {"ranks": list(ranks), "seconds": round(seconds, 4), "mb": mb,
                                    "gb_per_s": round(mb / 1024 / max(seconds, 1e-9), 3)}  # fmt: skip
    return out


def _sync(world: World) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def largest_member(cfg: CohortConfig, plan: CohortPlan | None) -> tuple[str, float]:
    """(member id, bytes of its files in one checkpoint by the plan's disk estimate) of the largest member."""
    disk = plan.disk if plan is not None and plan.disk is not None else checkpoint_disk(cfg)
    mid, parts = max(disk.members.items(), key=lambda kv: sum(kv[1].values()))
    return mid, float(sum(parts.values()))


def checkpoint_probe(run: CohortRun, member_id: str, work: Path) -> dict:
    """Write the largest member's checkpoint files (`Member.save`, what every checkpoint writes of it: weights,
    optimizer state) into `work` on output_dir's disk, then delete them; seconds and bytes (world rank 0)."""
    target = work / "checkpoint-probe"
    run.world.barrier()
    start = time.perf_counter()
    for m in models_to_save(run.slots):
        if m.id == member_id:
            m.save(target / m.id, write=run.world.rank == run.placement[member_id][0])
    run.world.barrier()
    seconds = time.perf_counter() - start
    written = held_bytes(target) if run.world.is_main else 0.0
    run.world.barrier()
    if run.world.is_main:
        shutil.rmtree(target, ignore_errors=True)
    return {"member": member_id, "seconds": round(seconds, 3), "bytes": written}


def install_report(cfg: CohortConfig) -> dict:
    """The report's start: the installed versions of what `cfg` uses against those tested, and CUDA's."""
    from vlm_corl.versions import cuda_line, version_checks

    needs = {"deepspeed"} if cfg.train.deepspeed else set()
    needs |= {"vllm"} if any(member_engine(cfg, m) == "vllm" for m in cfg.members) else set()
    needs |= {"peft"} if any(m.lora is not None for m in cfg.members) else set()
    versions = version_checks(needs)
    warnings = [v["line"] for v in versions if not v["ok"]]
    return {"verdict": None, "failure": None, "versions": versions, "cuda": cuda_line(), "warnings": warnings}


def run_preflight(cfg: CohortConfig, options: PreflightOptions | None = None) -> dict:
    """The preflight of `cfg` on this launch: every rank runs it and writes its report (`options.out`); returns
    world rank 0's report (the other ranks': their own), with `verdict` "ready" or "failed" and `failure`
    (phase, rank, member, error, fix, exit_status) for the first failure. Nothing is left in output_dir but what
    it held before (and preflight.json where `out` puts it there)."""
    options = options or PreflightOptions()
    report, work = install_report(cfg), Path(cfg.output_dir) / ".preflight"
    for name, value in nccl_environment(default_device().type).items():
        os.environ.setdefault(name, value)  # read when the process group is made; a user's own setting wins
    with giving_back():
        world = launch_world(options.timeout_s, need_group=cfg.train.deepspeed is not None)
        pf = Preflight(world, report, options)
        try:
            _phases(cfg, pf, work)
            report["verdict"] = "ready"
        except PreflightFailed as stop:
            report["verdict"], report["failure"] = "failed", asdict(stop.failure)
        finally:
            pf.watchdog.disarm()
        with pf.watchdog.lock:  # held by a watchdog that is ending the process: this waits for its exit
            pf.end()
        pf.watchdog.close()
        if pf.run is not None:
            release_run(pf.run)
        if world.is_main:
            shutil.rmtree(work, ignore_errors=True)
    return report


def _phases(cfg: CohortConfig, pf: Preflight, work: Path) -> None:
    """Every phase in order (`pf.run`: the run once loaded); the first failure raises PreflightFailed."""
    world, report = pf.world, pf.report
    with pf.phase("plan"):
        cfg, plan = plan_phase(cfg, world)
        small = preflight_config(cfg, world.size, pf.options.max_new_tokens, work)
        pf.plan = small_plan(small, world, plan)
    report["plan"] = None if pf.plan is None else pf.plan.to_dict()  # what the phases' peaks are compared with
    report["run_plan"] = None if plan is None else plan.to_dict()  # the user's config's, for the run itself
    report["settings"] = {"micro_batch_size": int(cfg.train.micro_batch_size), "prompts": small.data.batch_size,
                          "n": small.rollout.n, "max_new_tokens": small.rollout.max_new_tokens}  # fmt: skip
    report["config_warnings"] = config_warnings(cfg)  # the user's config's, not those of its shrunken copy
    if world.is_main:
        for warning in report["config_warnings"]:
            log.warning(warning)
    with pf.phase("load"):  # the run's start: data, members, their optimizers and engines
        pf.run = start_run(small, warn_config=False)
    pf.rank.members = [m.id for m in pf.run.members]
    tag_engines(pf.run)
    _steps(pf.run, pf, report)
    with pf.phase("collectives"):
        mb = pf.options.collective_mb or (64 if world.device.type == "cuda" else 4)
        pf.rank.collectives = collectives(pf.run, mb)
        pf.rank.collectives["exchange"] = {"seconds": pf.rank.phases["exchange"]["seconds"]}
    largest, planned = largest_member(cfg, plan)
    with pf.phase("checkpoint", largest):
        written = checkpoint_probe(pf.run, largest, work)
        written["plan_bytes"] = planned
        report["checkpoint"] = written
        if world.is_main and plan is not None and plan.disk is not None:
            check_checkpoint_disk(cfg, plan.disk, written)


def small_plan(small: CohortConfig, world: World, plan: CohortPlan | None) -> CohortPlan | None:
    """The plan of the config the preflight runs (its small batch, on this launch), by the same planner as the
    user's: the measured peaks are compared with it (the user's plan is sized for the full batch, so a measured
    phase would always look small beside it). None where the user's config is not planned."""
    if plan is None:
        return None
    return plan_cohort(small, launch_hardware(small, world.device, world.size))


def write_report(report: dict, out: Path | None, rank: int) -> str | None:
    """preflight.json at `out` (world rank 0), and after a failure preflight.rank<r>.json beside it (rank r: its
    own part; rank 0 may have ended without it), each written whole or not at all (a rank may be ended while it
    writes). A write that fails (the disk filled, the folder went away) returns why, in place of raising: the
    verdict the minutes of checks found is printed all the same."""
    if out is None or (rank != 0 and report["verdict"] == "ready"):  # rank 0's report holds every rank's then
        return None
    try:
        _write_report(report, out, rank)
    except OSError as err:
        return f"{err.filename or out}: {err.strerror or err}"
    return None


def _write_report(report: dict, out: Path, rank: int) -> None:
    if rank == 0 and report["verdict"] == "ready":  # an earlier failed preflight's parts would read as this one's
        for stale in out.parent.glob(f"{out.stem}.rank*{out.suffix}"):
            stale.unlink(missing_ok=True)
    path = out if rank == 0 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=1, default=str) + "\n")
    partial.replace(path)


def _steps(run: CohortRun, pf: Preflight, report: dict) -> None:
    """The loop's phases over two steps (see the module docstring); report["members"]: {member id: what was
    measured}, set before the push check (a failed check's numbers are reported too)."""
    cfg, world = run.cfg, run.world
    indices = run.sampler.next_batch()
    batch = [run.examples[i] for i in indices]
    ids, spec_ids = [ex.id for ex in batch], [s.id for s in run.specs]
    with pf.phase("render"):
        prompts, too_long = render_phase(run, batch)
        if too_long:
            p, member, tokens = too_long[0]
            raise UserError(
                f"example {batch[p].id!r} renders to {tokens} tokens for member {member}, over "
                f"rollout.max_prompt_tokens={cfg.rollout.max_prompt_tokens}: raise it or lower data.max_image_pixels"
            )
    measured = {}
    for step, suffix in ((0, ""), (1, "_after_push")):
        with pf.phase("rollout" + suffix):
            groups, rollout_s = rollout_phase(run, prompts, step)
        with pf.phase("exchange" if step == 0 else "exchange_after_push"):
            exchanged = exchange(world, ids, extract_phase(run, groups, batch), spec_ids)
        rewards = half_right(exchanged[3])
        advantages = [group_advantages(r, cfg.algo.scale_rewards, cfg.algo.adv_eps) for r in rewards]
        with pf.phase("update" + suffix):  # every engine sleeps first (vLLM sleep mode)
            updates = update_phase(run, groups, advantages, rewards, exchanged[3], exchanged[6])
            follow_students(run, step)
        updates = _every_members(world, updates)
        for s in run.slots:
            responses = [r for g in groups[run.slots.index(s)] for r in g.responses]
            tokens = sum(len(r.token_ids) for r in responses)
            seconds = max(rollout_s[s.id], 1e-9)
            measured.setdefault(s.member.id, {})[f"rollout{suffix}"] = {
                "prompts": len(groups[run.slots.index(s)]), "responses": len(responses), "tokens": tokens,
                "seconds": round(rollout_s[s.id], 3), "tokens_per_s": round(tokens / seconds, 1)}  # fmt: skip
        if step == 0:
            with pf.phase("perturb"):
                moved = {m.id: perturb(m) for m in run.members if m.cfg.trainable}
            with pf.phase("sync"):  # the push, then the wake-up of every engine the update put to sleep
                sync_phase(run)
    limit = cfg.algo.rollout_is_max_abs_dlogp or PUSH_LIMIT
    out: dict = {}
    for part, part_moved in world.all_gather((measured, moved)):
        for mid, values in part.items():
            out.setdefault(mid, {}).update(values)
        for mid, what in part_moved.items():
            out[mid]["perturbed"] = what
    for mid, stats in updates.items():
        out.setdefault(mid, {})["push_gap_nats"] = stats.get("is_abs_dlogp")
        out[mid]["update"] = {k: stats.get(k) for k in ("loss", "grad_norm", "trained_seqs", "update_tokens",
                                                          "compute_dtype")}  # fmt: skip
        out[mid]["engine"] = member_engine(cfg, next(m for m in cfg.members if m.id == mid))
        out[mid]["push_limit_nats"] = limit
    report["members"] = out  # reported whatever the guard says next
    with pf.phase("push_check"):
        check_rollout_mismatch(2, updates, limit, None)


def _every_members(world: World, updates: dict) -> dict:
    """Every member's update stats on every rank (from its first rank)."""
    merged: dict = {}
    for part in world.all_gather(updates):
        for mid, stats in part.items():
            merged.setdefault(mid, stats)
    return merged


def checkpoint_need(disk: DiskPlan, written: dict) -> float:
    """Bytes the run's checkpoints will take by the measured one: the plan's total (each checkpoint times the
    copies on disk at once, train.keep_last + 1, and RUN/best/) scaled by the largest member's measured over
    planned bytes (what under-counts it under-counts the others alike)."""
    return disk.total * written["bytes"] / written["plan_bytes"]


def check_checkpoint_disk(cfg: CohortConfig, disk: DiskPlan, written: dict) -> None:
    """The measured checkpoint scaled to the whole run (`checkpoint_need`) against the free space of
    output_dir's disk: a plan that under-counts the files is found here, not when the disk fills. Raises
    UserError when it does not fit; records both numbers in `written`."""
    if not written["plan_bytes"]:
        return
    need = checkpoint_need(disk, written)
    free = shutil.disk_usage(Path(cfg.output_dir)).free
    written["run_needs_bytes"], written["free_bytes"] = need, free
    if need > free:
        raise UserError(
            f"checkpoint disk: one checkpoint of {written['member']} took {size(written['bytes'])} (planned "
            f"{size(written['plan_bytes'])}), so the run's {disk.copies} checkpoints on disk at once need about "
            f"{size(need)}, but output_dir {cfg.output_dir} has {size(free)} free: free space there, lower "
            "train.keep_last, or choose an output_dir on a larger disk"
        )


def _peak_warnings(ranks: list[dict]) -> list[str]:
    """A phase whose measured peak (CUDA) is over the plan's by more than OVER_PLAN: the plan under-counts it."""
    out = []
    for r in ranks:
        if r["peak_source"] != "cuda_allocator":
            continue
        for name, p in r["phases"].items():
            if p.get("peak_gb") and p.get("plan_gb") and p["peak_gb"] > OVER_PLAN * p["plan_gb"]:
                out.append(
                    f"rank {r['rank']}: the {name} phase peaked at {p['peak_gb']:.2f} GB, over the plan's "
                    f"{p['plan_gb']:.2f} GB: the run's headroom is smaller than `corl plan` says"
                )
    return out

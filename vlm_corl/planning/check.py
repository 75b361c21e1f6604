"""`train`'s memory check: the plan of this launch (`plan_cohort` on the device every rank has), made on every
rank before any model loads, so that a layout that cannot fit stops every rank alike with exit 2
(`train.check_memory`); beside it the disk check: the free space on output_dir's disk against what the run's
checkpoints will take (`vlm_corl.planning.disk`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from vlm_corl.config import CohortConfig, ConfigError
from vlm_corl.errors import UserError
from vlm_corl.members.member import member_family
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import CohortPlan, Hardware, plan_cohort
from vlm_corl.planning.fixes import fixes
from vlm_corl.planning.micro_batch import with_micro_batch
from vlm_corl.planning.render import render_plan, verdict_line

log = logging.getLogger("vlm_corl")


def check_mode(cfg: CohortConfig, device: torch.device) -> str:
    """train.check_memory resolved: auto = error on CUDA, warn elsewhere."""
    mode = cfg.train.check_memory
    return ("error" if device.type == "cuda" else "warn") if mode == "auto" else mode


def launch_hardware(cfg: CohortConfig, device: torch.device, processes: int) -> Hardware:
    """The hardware this launch runs on: train.device_memory_gb, else the CUDA card's memory, else the host's RAM
    over the node's processes (LOCAL_WORLD_SIZE, as torchrun and accelerate set it)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    if cfg.train.device_memory_gb is not None:
        per_rank, what = cfg.train.device_memory_gb * GB, "train.device_memory_gb"
    elif device.type == "cuda":
        per_rank, what = (
            float(torch.cuda.get_device_properties(device).total_memory),
            torch.cuda.get_device_name(device),
        )
    else:
        per_rank = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(local, 1)
        what = "host RAM"
    label = f"{processes} rank{'s' * (processes > 1)} of {per_rank / GB:.1f} GB ({what})"
    return Hardware(processes, per_rank, cuda=device.type == "cuda", label=label, ranks_per_node=local)


def resolve_micro_batch(cfg: CohortConfig, device: torch.device, processes: int, is_main: bool) -> CohortConfig:
    """`cfg` with `train.micro_batch_size: auto` resolved for this launch (`planning.micro_batch`: on CUDA the
    largest micro-batch whose plan fits, elsewhere 8); rank 0 logs the choice."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    if device.type == "cuda":
        for m in cfg.members:  # a directory the planner cannot read gets the loader's message, not a traceback
            member_family(m, m.model)
    return with_micro_batch(cfg, launch_hardware(cfg, device, processes), log_it=is_main)


def check_launch(cfg: CohortConfig, device: torch.device, processes: int, is_main: bool) -> CohortPlan | None:
    """The plan of this launch (None with train.check_memory: off). Under `error` a plan that does not fit
    raises ConfigError with the planner's verdict and its fixes; under `warn` rank 0 logs them."""
    mode = check_mode(cfg, device)
    if mode == "off":
        return None
    for m in cfg.members:  # a directory the planner cannot read gets the loader's message, not a traceback
        member_family(m, m.model)
    plan = plan_cohort(cfg, launch_hardware(cfg, device, processes))
    if plan.fits:
        if is_main:
            log.info("memory plan: %s", verdict_line(plan))
        return plan
    plan.fixes = fixes(cfg, plan)
    advice = "; ".join(
        f"{f['change']} ({' '.join(f['overrides'])}{', ' + f['launch'] if 'launch' in f else ''}: "
        f"saves {f['saves_gb']:.1f} GB{', fits' if f['fits'] else ''})"
        for f in plan.fixes[:4]
    )
    message = f"memory plan: {verdict_line(plan)}" + (f". Changes that help: {advice}" if advice else "")
    if mode == "error":
        raise ConfigError(
            [
                message + ". Plan it with `corl plan --config FILE --suggest`, or set "
                "train.check_memory: warn to try anyway"
            ],
            ["train.check_memory"],
        )
    if is_main:
        log.warning("%s\n%s", message, render_plan(plan, cfg.name))
    return plan


class DiskTooSmall(UserError):
    """output_dir's disk cannot hold the run's checkpoints (names both sizes, the directory and what to do)."""


def check_disk(cfg: CohortConfig, world, plan: CohortPlan | None) -> None:
    """Before any model loads: stop (train.check_memory error or auto, on any device: a disk is a disk) or warn
    (warn) when the free space on output_dir's disk is below what the checkpoints need (`plan.disk`, less what
    checkpoints already in output_dir hold); nothing with check_memory off (`plan` None). Every rank reads the
    free space and all decide on the smallest (one collective), so they stop alike."""
    if plan is None or plan.disk is None:
        return
    mode = "error" if cfg.train.check_memory == "auto" else cfg.train.check_memory
    where = existing_parent(Path(cfg.output_dir))
    need = plan.disk.total - held_bytes(Path(cfg.output_dir) / "checkpoints")
    free = min(world.all_gather(shutil.disk_usage(where).free))
    if free >= need:
        return
    disk = plan.disk
    message = (
        f"checkpoint disk: the run's checkpoints need {size(need)} ({size(disk.one)} per checkpoint x {disk.copies}: "
        f"{disk.copies_text()}{f', and {size(disk.best)} of best weights' if disk.best else ''}) but the disk of "
        f"output_dir {cfg.output_dir} ({where}) has {size(free)} free"
    )
    if mode == "error":
        raise DiskTooSmall(
            message + ": free space there, lower train.keep_last, or choose an output_dir on a larger disk (or set "
            "train.check_memory: warn to try anyway)"
        )
    if world.is_main:
        log.warning("%s; the run goes on (train.check_memory: %s) and stops when the disk fills", message, mode)


def size(nbytes: float) -> str:
    """Bytes as a person reads them: GB, or MB below a tenth of one."""
    return f"{nbytes / GB:.2f} GB" if abs(nbytes) >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest parent that exists (where a directory not made yet will be)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def held_bytes(directory: Path) -> float:
    """Bytes of the files under `directory` (checkpoints already written: a resumed run's count toward
    train.keep_last, an overwritten run's are removed); 0 when it does not exist."""
    if not directory.is_dir():
        return 0.0
    return float(sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()))


def against_plan(plan: CohortPlan | None, rank: int, peaks_gb: dict[str, float]) -> dict[str, float]:
    """The metrics fields that set a rank's measured CUDA peaks (GB by phase) beside its plan: the plan's peak
    for the rank (`plan_gb`) and the largest measured peak over it (`peak_over_plan`); {} without a plan or
    peaks (off CUDA)."""
    if plan is None or not peaks_gb:
        return {}
    planned = plan.peak_of(rank) / GB
    return {"plan_gb": planned, "peak_over_plan": max(peaks_gb.values()) / planned}


def write_plan(plan: CohortPlan, run_dir: Path) -> None:
    """plan.json in the run directory (rank 0)."""
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=1) + "\n")

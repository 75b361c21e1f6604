"""The run directory's summary at the end of a run: last metrics per member, collapse warnings, the guard's
stop, best models, data records kept and skipped, and the environment a result depends on (summary.json)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlm_corl.distributed.world import World
from vlm_corl.members.engines.vllm import MODEL_RUNNERS
from vlm_corl.training.monitor.collapse import CollapseTracker, eval_drops
from vlm_corl.training.run.checkpoint import latest_checkpoint

if TYPE_CHECKING:
    from vlm_corl.training.run.setup import CohortRun


def finish_run(run: CohortRun, stopped: dict | None, stop: dict | None = None) -> dict:
    """The run's summary (written by rank 0 to summary.json): last metrics per member, collapse warnings, the
    guard's stop (`stopped`: {action, warning, message, step}), a callback's stop (`stop`: {callback, event, step,
    reason}; with either, `steps` is the step the run ended at), best models, data records kept and skipped, and
    the environment."""
    fallbacks = {
        sid: n
        for part in run.world.all_gather({s.id: s.renderer.view_fallbacks for s in run.slots})
        for sid, n in part.items()
    }
    summary = _summary(run.cfg, run.collapse, run.run_dir, fallbacks)
    summary["reward_functions"] = [{"name": f.name, "weight": f.weight} for f in run.reward_funcs]
    if run.cfg.eval.max_category_drop:
        summary["collapse_warnings"] += eval_drops(run.eval_history, run.cfg.eval.max_category_drop)
    summary["stopped_by_guard"] = None if stopped is None else {k: stopped[k] for k in ("action", "warning", "step")}
    summary["stopped_by_callback"] = stop
    for early in (stopped, stop):  # an early end: the steps trained, not the ones train.max_steps asked for
        if early is not None:
            summary["steps"] = early["step"]
    summary["best"] = run.best or None
    summary["nonfinite_skipped"] = run.nonfinite.total  # optimizer steps the numerical guard skipped, per member
    report = run.data_report
    skipped, examples = dict(report.skipped), {k: list(v) for k, v in report.samples.items()}
    if run.sampler.excluded:  # prompts longer than rollout.max_prompt_tokens, skipped for every member
        skipped["prompt_too_long"] = len(run.sampler.excluded)
        examples["prompt_too_long"] = [
            f"{example_id}: {d['tokens']} tokens for {d['member']}" for example_id, d in list(run.too_long.items())[:5]
        ]
    used = report.kept if report.used is None else report.used
    summary["data"] = {"used": used, "kept": report.kept, "skip": report.skip_first, "skipped": skipped,
                       "skipped_examples": examples}  # fmt: skip
    summary["environment"] = environment(run.world)
    if run.sink is not None:
        (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        run.sink.close(summary)
    return summary


def environment(world: World) -> dict:
    """What a result depends on beyond the config: library versions, torch threads, processes, git commit, and the
    model runner of this process's vLLM engines (docs/vllm.md)."""
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
        "vllm_model_runners": sorted(MODEL_RUNNERS),
    }


def _summary(cfg, collapse: CollapseTracker, run_dir: Path, view_fallbacks: dict[str, int]) -> dict:
    last = collapse.latest
    newest = latest_checkpoint(run_dir)
    return {
        "run_dir": str(run_dir),
        "steps": cfg.train.max_steps,
        "reward_mode": cfg.reward.mode,
        "members": {
            mid: {k: row.get(k) for k in ("reward_mean", "agreement", "pseudo_label_acc", "answer_acc")}
            for mid, row in last.items()
        },
        "view_fallbacks": view_fallbacks,
        # each slot's first detection of "diversity falls while agreement rises" (vlm_corl.training.monitor.collapse)
        "collapse_warnings": collapse.warnings(),
        "checkpoint": str(newest) if newest else None,
    }

"""The checkpoint phase: the cohort's state and every model's files for one step (each model written by its
first rank, the cohort state by world rank 0; in the background with train.async_checkpoint), after checking
that every rank of a member holds the same, finite weights."""

from __future__ import annotations

import math

from vlm_corl.config.loading import config_to_dict
from vlm_corl.distributed.world import weights_checksum
from vlm_corl.members.deepspeed_update import state_files
from vlm_corl.training.rewards.reward_funcs import function_name
from vlm_corl.training.run.checkpoint import latest_checkpoint, required_files, save_checkpoint
from vlm_corl.training.run.numerics import NonFiniteStopped
from vlm_corl.training.run.setup import CohortRun
from vlm_corl.training.run.slots import models_to_save, owner


def checkpoint_phase(run: CohortRun, step: int, rows: list[dict]) -> None:
    """Every rank takes part; each model's first rank writes it, world rank 0 the cohort state (atomic).

    The step's metrics rows go into the cohort state too: they are written to metrics.jsonl after the
    checkpoint, and a run killed in between gets them back on resume."""
    models = models_to_save(run.slots)
    replicas = _check_replicas(run, models)
    writers = {s.member.id: run.world.rank == run.placement[owner(s)][0] for s in run.slots}
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

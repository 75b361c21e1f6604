"""The update and sync phases: each hosted trainable member's optimizer step on its shard of all its slots'
sequences, EMA teachers following their students, and the engines loading the new weights."""

from __future__ import annotations

import torch

from vlm_corl.members.rollout import RolloutGroup
from vlm_corl.members.update import Sequence, policy_update
from vlm_corl.training.rewards.grpo import nonzero_variance_groups
from vlm_corl.training.run.setup import CohortRun
from vlm_corl.training.run.slots import ema_update, teacher_decay


def update_phase(
    run: CohortRun,
    groups: list[list[RolloutGroup]],
    advantages: list[torch.Tensor],
    rewards: torch.Tensor,
    lengths: list[list[list[int]]],
    truncated: list | None = None,
) -> dict:
    """Each hosted trainable member takes one optimizer step on its shard of all its slots' sequences
    (gradients summed over its ranks). truncated: (N, B, K) responses cut at the length budget, left out of the
    loss with algo.mask_truncated. Returns {member id: update stats}."""
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
    return updates


def follow_students(run: CohortRun, step: int) -> None:
    """After the update, each EMA teacher (co_rewarding_2) moves toward its student by the decay of `step`
    (0-based; reward.teacher_decay_start to _end over the run)."""
    r = run.cfg.reward
    decay = teacher_decay(step, run.cfg.train.max_steps, r.teacher_decay_start, r.teacher_decay_end)
    for s in run.slots:
        if s.follows is not None:
            ema_update(s.member.model, s.follows.full_weights(), decay)


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

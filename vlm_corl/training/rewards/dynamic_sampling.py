"""DAPO's dynamic sampling in a cohort (algo.resample_zero_variance): before the advantages, the step's questions
that no trained member can learn from are replaced by fresh ones, rolled out and rewarded like the rest.

DAPO (Yu et al. 2025, arXiv 2503.14476, section 3.2) over-samples and keeps only the groups whose accuracy is
strictly between 0 and 1, until the batch is full: a group whose K rewards are all equal has zero advantage and
no gradient, so it only shrinks the batch that trains.

What "zero variance" means with several members. Every member answers the same questions (the lockstep of
`LockstepSampler`), and a question may give one member equal rewards and another varied ones. A question is
replaced when its groups have zero variance for *every* trained slot (`rewards.cohort_zero_variance`): while one
trained member can learn from it, it stays (the zero-advantage groups of the others on it cost nothing but
their rollouts, and dropping it would take that member's signal away); frozen peers and EMA teachers do not
decide. So every member keeps the same questions, and the lockstep holds. The decision reads the final reward
(the mode's, the reward functions', the overlong penalty): it is the reward the advantages are computed from.

How the ranks stay together. The rewards are exchanged, so every rank finds the same zero-variance positions Z.
The fresh questions come from the data sampler (`LockstepSampler.draw`, never one of the step's questions so
far), whose state every rank holds alike and every checkpoint saves: the ranks draw the same questions and a
resumed run draws what the uninterrupted one would have. Replacement j takes batch position Z[j], so the rank
whose shard holds that position rolls it out and later trains on it: no rollout moves between ranks. Each
member's share of the replacements (`sub_shards`) is contiguous, as its shard of the batch is; a round's samples
are seeded by (run, slot, step, round) and j, so they do not depend on the number of ranks either.

The bound: at most algo.resample_max_rounds rounds a step, each rolling out the questions still zero-variance
(K responses for every slot). What is still zero-variance after them, or when the data has no question left to
try, stays in the batch with zero advantage (and is dropped from the loss with algo.filter_zero_variance).
Metrics (every row of the step): `resampled_groups` (questions drawn in addition), `resample_rounds`,
`zero_variance_left`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlm_corl.training.rewards.modes import RewardOutput, cohort_zero_variance

if TYPE_CHECKING:
    from vlm_corl.data.records import Example
    from vlm_corl.members.rollout import RolloutGroup


@dataclass
class StepRollouts:
    """What the phases from sampling to reward leave of a batch (the step's, or a round's fresh questions)."""

    indices: list[int]  # (B,) the examples' indices in the training data (the sampler's)
    batch: list[Example]  # (B,)
    groups: list[list[RolloutGroup]]  # per slot this rank hosts: the groups of its member's shard, in order
    exchanged: list[list]  # per exchanged field: (N, B, K) for every slot of the cohort
    scored: RewardOutput  # rewards (N, B, K), parts, labels (N, B)
    rollout_s: dict[str, float]  # slot id -> rollout seconds


# (batch positions to refill, round from 1, example indices not to draw) -> the fresh questions for the first
# positions (as many as the data gives), or None when it has none left
RoundFn = Callable[[list[int], int, set[int]], "StepRollouts | None"]


def zero_variance_positions(rewards: torch.Tensor, trained: Sequence[bool]) -> list[int]:
    """The batch positions, ascending, of the questions no trained slot learns from (rewards: (N, B, K))."""
    return torch.nonzero(cohort_zero_variance(rewards, trained)).flatten().tolist()


def sub_shards(shards: Mapping[str, range], positions: Sequence[int]) -> dict[str, range]:
    """Each member's share of replacements for the ascending batch `positions`: the indices j with positions[j]
    in the member's shard of the batch (`shards`, its contiguous range), a contiguous range too.

    E.g. shards {a: 0..1, b: 2..3} and positions [1, 2, 3]: a gets j in [0], b gets j in [1, 2]."""
    return {mid: range(bisect_left(positions, r.start), bisect_left(positions, r.stop)) for mid, r in shards.items()}


def merge_scored(old: RewardOutput, new: RewardOutput, positions: Sequence[int]) -> RewardOutput:
    """`old` with question positions[j] scored as `new`'s question j (rewards, every part, labels)."""
    where = torch.tensor(list(positions), dtype=torch.long)

    def put(t: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        out[:, where] = fresh.to(out.dtype)
        return out

    labels = [list(row) for row in old.labels]
    for n, row in enumerate(labels):
        for j, p in enumerate(positions):
            row[p] = new.labels[n][j]
    parts = {name: put(part, new.parts[name]) for name, part in old.parts.items()}
    return RewardOutput(put(old.rewards, new.rewards), parts, labels)


def merge(
    step: StepRollouts, fresh: StepRollouts, positions: Sequence[int], shards: Mapping[str, range], owners: list[str]
) -> StepRollouts:
    """`step` with the questions at ascending batch `positions` replaced by `fresh`'s (its j-th at positions[j]).

    shards: each hosted member's shard of the batch on this rank (`CohortRun.shards`); owners: per hosted slot,
    the member whose shard it rolls out (a slot's groups follow that shard, `fresh`'s its `sub_shards` share).
    Rollout seconds add up."""
    sub = sub_shards(shards, positions)
    indices, batch = list(step.indices), list(step.batch)
    for j, p in enumerate(positions):
        indices[p], batch[p] = fresh.indices[j], fresh.batch[j]
    groups = []
    for n, owner in enumerate(owners):
        mine, start, first = list(step.groups[n]), shards[owner].start, sub[owner].start
        for j in sub[owner]:
            mine[positions[j] - start] = fresh.groups[n][j - first]
        groups.append(mine)
    exchanged = []
    for old, new in zip(step.exchanged, fresh.exchanged):
        field = [list(per_slot) for per_slot in old]
        for per_slot, fresh_slot in zip(field, new):
            for j, p in enumerate(positions):
                per_slot[p] = fresh_slot[j]
        exchanged.append(field)
    slots = {**step.rollout_s, **fresh.rollout_s}
    seconds = {k: step.rollout_s.get(k, 0.0) + fresh.rollout_s.get(k, 0.0) for k in slots}
    return StepRollouts(indices, batch, groups, exchanged, merge_scored(step.scored, fresh.scored, positions), seconds)


def resample(
    step: StepRollouts,
    trained: Sequence[bool],
    max_rounds: int,
    again: RoundFn,
    shards: Mapping[str, range],
    owners: list[str],
) -> tuple[StepRollouts, dict[str, int]]:
    """Replace the zero-variance questions of `step` round by round: `again(positions, round, avoid)` rolls out
    and rewards fresh questions for the positions (never one of `avoid`: the step's questions so far); stops when
    none is zero-variance, after `max_rounds` rounds, or when the data has no question left (`again` gives None).
    Returns the step's rollouts and its metrics {resampled_groups, resample_rounds, zero_variance_left}."""
    tried = set(step.indices)
    zero = zero_variance_positions(step.scored.rewards, trained)
    replaced = rounds = 0
    while zero and rounds < max_rounds:
        fresh = again(zero, rounds + 1, tried)
        if fresh is None:
            break
        rounds += 1
        positions = zero[: len(fresh.indices)]
        step = merge(step, fresh, positions, shards, owners)
        tried |= set(fresh.indices)
        replaced += len(positions)
        zero = zero_variance_positions(step.scored.rewards, trained)
    return step, {"resampled_groups": replaced, "resample_rounds": rounds, "zero_variance_left": len(zero)}

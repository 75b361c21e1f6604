"""Cohort rewards: votes, pseudo-label topologies and reward modes, as plain functions over the cohort batch.

A reward function takes the whole cohort batch (every member's extracted answers, after the exchange phase)
and returns, per member, example and response, an overall score plus named parts, and the label that
supervised each member (for diagnostics). Label-free modes never see gold answers: the loop fills
`CohortBatch.gold` only for a mode registered with `uses_gold=True`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from vlm_corl.data.answers import answers_equivalent, consensus, plurality_vote
from vlm_corl.registry import REWARDS
from vlm_corl.training.rewards.grpo import nonzero_variance_groups

if TYPE_CHECKING:
    from vlm_corl.config.schema import RewardConfig

Answers = list[list[list[str | None]]]  # (N members, B examples, K responses)


@dataclass(frozen=True)
class CohortBatch:
    """What the reward phase sees: answers of every member on the same B examples, K responses each."""

    member_ids: tuple[str, ...]
    answers: Answers  # (N, B, K) extracted answers; None = unparseable
    texts: list[list[list[str]]]  # (N, B, K) response texts (for custom and format rewards)
    format_ok: list[list[list[bool]]]  # (N, B, K) response follows the member's prompt format
    choices: list[tuple[str, ...] | None]  # (B,) multiple-choice options, if any
    gold: list[str | None]  # (B,) gold answers; all None unless the mode uses gold
    scores: dict[str, Tensor] = field(default_factory=dict)  # per-response statistics (N, B, K), e.g. entropy

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.answers), len(self.answers[0]), len(self.answers[0][0])


@dataclass(frozen=True)
class RewardOutput:
    """rewards = sum of weighted parts; labels[n][b] is member n's pseudo-label (None = abstain / none)."""

    rewards: Tensor  # (N, B, K)
    parts: dict[str, Tensor]  # name -> (N, B, K), unweighted
    labels: list[list[str | None]]  # (N, B)


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward mode: its function, whether it may read gold answers, whether it needs per-response
    sampling statistics (`CohortBatch.scores`), and the cohort layout it runs on (`vlm_corl.training.run.slots`):
    "members" (one slot per member), "two_views" (one member, original + its view), "ema_teacher" (one member
    and its EMA teacher)."""

    fn: Callable[..., RewardOutput]
    uses_gold: bool = False
    needs_scores: bool = False
    layout: str = "members"


def resolve_reward(cfg: RewardConfig) -> RewardSpec:
    """The registered reward mode of a `RewardConfig` (reward functions are added on top: `reward_funcs`)."""
    return REWARDS.get(cfg.mode)


def reward_mode(
    name: str, uses_gold: bool = False, needs_scores: bool = False
) -> Callable[[Callable[..., RewardOutput]], Callable[..., RewardOutput]]:
    """Register a cohort reward function `fn(batch, cfg) -> RewardOutput` under `name`."""

    def add(fn: Callable[..., RewardOutput]) -> Callable[..., RewardOutput]:
        REWARDS.register(name)(RewardSpec(fn, uses_gold, needs_scores))
        return fn

    return add


# ---- votes ---------------------------------------------------------------------------------------------


def member_votes(batch: CohortBatch, threshold: float) -> list[list[str | None]]:
    """(N, B) each member's own plurality vote per example."""
    return [
        [plurality_vote(group, threshold, batch.choices[b]) for b, group in enumerate(member)]
        for member in batch.answers
    ]


def peer_consensus(votes: list[list[str | None]], batch: CohortBatch) -> list[list[str | None]]:
    """(N, B) for each member, the consensus of the OTHER members' votes (its own never counts)."""
    n, b = len(votes), len(votes[0])
    return [
        [consensus([votes[m][j] for m in range(n) if m != i], batch.choices[j]) for j in range(b)] for i in range(n)
    ]


# ---- labels -> rewards ---------------------------------------------------------------------------------


def _match(labels: list[list[str | None]], batch: CohortBatch) -> Tensor:
    """(N, B, K) 1.0 where the response's answer is equivalent to its member's label (label read as gold)."""
    n, b, k = batch.shape
    out = torch.zeros(n, b, k)
    for i in range(n):
        for j in range(b):
            if labels[i][j] is None:
                continue
            for r, ans in enumerate(batch.answers[i][j]):
                out[i, j, r] = float(answers_equivalent(labels[i][j], ans, batch.choices[j]))
    return out


def combine(
    agreement: Tensor, batch: CohortBatch, cfg: RewardConfig, labelled: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """Overall score = agreement + format_weight * format; groups without a label (labelled False) get 0."""
    fmt = torch.tensor(batch.format_ok, dtype=torch.float32)
    total = (agreement + cfg.format_weight * fmt) * labelled.unsqueeze(-1)
    return total, {"agreement": agreement, "format": fmt}


def _label_reward(labels: list[list[str | None]], batch: CohortBatch, cfg) -> RewardOutput:
    labelled = torch.tensor([[lab is not None for lab in row] for row in labels], dtype=torch.float32)
    total, parts = combine(_match(labels, batch), batch, cfg, labelled)
    return RewardOutput(total, parts, labels)


@reward_mode("ring")
def ring_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Co-RL ring: member n is supervised by the vote of member n-1 (mod N); N=2 is mutual supervision."""
    votes = member_votes(batch, cfg.vote_threshold)
    n = len(votes)
    return _label_reward([votes[(i - 1) % n] for i in range(n)], batch, cfg)


@reward_mode("peers")
def peers_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Co-RL peers: member n's label is the plurality of all other members' votes (a tie abstains)."""
    return _label_reward(peer_consensus(member_votes(batch, cfg.vote_threshold), batch), batch, cfg)


@reward_mode("soft")
def soft_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Co-RL soft: a response earns the fraction of other members whose vote equals its answer.

    The logged label is the others' consensus (diagnostic only: it does not set the reward).
    """
    votes = member_votes(batch, cfg.vote_threshold)
    n, b, k = batch.shape
    agreement = torch.zeros(n, b, k)
    for i in range(n):
        others = [m for m in range(n) if m != i]
        for j in range(b):
            for r, ans in enumerate(batch.answers[i][j]):
                agreeing = sum(answers_equivalent(votes[m][j], ans, batch.choices[j]) for m in others)
                agreement[i, j, r] = agreeing / len(others)
    total, parts = combine(agreement, batch, cfg, torch.ones(n, b))
    return RewardOutput(total, parts, peer_consensus(votes, batch))


@reward_mode("self_vote")
def self_vote_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """TTRL baseline: each member is supervised by its own plurality vote."""
    return _label_reward(member_votes(batch, cfg.vote_threshold), batch, cfg)


@reward_mode("gt", uses_gold=True)
def gt_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Reference upper bound: GRPO with the gold answer (the only mode that reads labels for reward)."""
    n = len(batch.answers)
    return _label_reward([list(batch.gold) for _ in range(n)], batch, cfg)


@reward_mode("self_certainty", needs_scores=True)
def self_certainty_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Intuitor-style baseline: reward = the response's mean per-token KL(uniform || p), its self-certainty."""
    return _intrinsic(batch, "self_certainty", sign=1.0)


@reward_mode("entropy", needs_scores=True)
def entropy_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Entropy-minimisation baseline (RENT): reward = minus the response's mean per-token entropy."""
    return _intrinsic(batch, "entropy", sign=-1.0)


def _intrinsic(batch: CohortBatch, stat: str, sign: float) -> RewardOutput:
    n, b, _ = batch.shape
    score = batch.scores[stat]  # (N, B, K)
    return RewardOutput(sign * score, {stat: score}, [[None] * b for _ in range(n)])


def paired_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Slots come in pairs (2k, 2k+1) that are two sides of one model; each is labelled by its partner's vote.

    co_rewarding_1: responses to the original wording are labelled by the vote on the member's paraphrase, and
    vice versa; co_rewarding_2: the member is labelled by the vote of its EMA teacher's K answers (the teacher's
    own labels are never used: it does not train). See `vlm_corl.training.run.slots` for the layouts.
    """
    votes = member_votes(batch, cfg.vote_threshold)
    return _label_reward([votes[i ^ 1] for i in range(len(votes))], batch, cfg)


def peers_ema_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """Co-RL peers with slowly updated voters: member n's label is the plurality of the OTHER members' EMA
    teachers' votes (a tie abstains). Slots come in pairs (2k: member k, 2k+1: its teacher, as co_rewarding_2
    lays them out); a teacher's own label is None (it does not train).

    Why: under `peers` the labels move with the learners, so a cohort can chase its own drift (the easy-vqa
    experiment: labels 0.95 right at the start decayed with the members); frozen peers' labels stay put but never
    improve. A teacher follows its member with the EMA's lag (reward.teacher_decay_start/end)."""
    votes = member_votes(batch, cfg.vote_threshold)
    teachers = votes[1::2]
    labels: list[list[str | None]] = []
    for i in range(len(teachers)):
        others = [t for k, t in enumerate(teachers) if k != i]
        labels.append([consensus([o[j] for o in others], batch.choices[j]) for j in range(len(votes[0]))])
        labels.append([None] * len(votes[0]))
    return _label_reward(labels, batch, cfg)


# ---- which questions carry a gradient -----------------------------------------------------------------


def cohort_zero_variance(rewards: Tensor, trained: Sequence[bool]) -> Tensor:
    """(B,) bool: the questions no trained slot can learn from: for every trained slot n, question b's K rewards
    are all equal (`grpo.nonzero_variance_groups` false), so each of its groups has zero advantage and carries no
    GRPO gradient (algo.resample_zero_variance replaces them).

    DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2) keeps a group only when
    0 < accuracy < 1, i.e. its rewards vary. In a cohort every slot answers the same question, so a question
    stays while any trained slot's group on it varies (the others' zero-advantage groups on it cost nothing);
    frozen peers and EMA teachers (trained False) never decide. rewards: (N, B, K); trained: (N,).
    With no trained slot nothing is zero-variance (there is nothing to resample for)."""
    rows = [nonzero_variance_groups(r) for r, t in zip(rewards, trained) if t]
    if not rows:
        return torch.zeros(rewards.shape[1], dtype=torch.bool)
    return ~torch.stack(rows).any(dim=0)


# ---- shaping added to any mode's reward ---------------------------------------------------------------


def overlong_penalty(lengths: Tensor, max_len: int, cache: int) -> Tensor:
    """DAPO's soft overlong punishment of each response's length |y| (algo.overlong_penalty = L_cache):

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                      -1                                 if |y| > L_max

    (Yu et al. 2025, "DAPO", arXiv 2503.14476, section 3.4: overlong reward shaping). Here L_max is
    rollout.max_new_tokens: a response cut at the budget has |y| = L_max and gets -1, the penalty falls linearly
    over the last L_cache tokens before it. lengths: response tokens, any shape; 1 <= cache <= max_len.
    Returns the penalty (float, lengths' shape), in [-1, 0]."""
    if not 1 <= cache <= max_len:
        raise ValueError(f"the overlong window must be 1..{max_len} tokens (rollout.max_new_tokens), got {cache}")
    y = lengths.float()
    free = max_len - cache
    return torch.where(y > max_len, -1.0, ((free - y) / cache).clamp(max=0.0))


def add_overlong_penalty(
    scored: RewardOutput, lengths: Tensor, max_len: int, cache: int, factor: float = 1.0
) -> RewardOutput:
    """The rewards plus factor x `overlong_penalty` per response (DAPO adds it to the task reward); the penalty,
    unweighted, becomes the part "overlong" (`reward_overlong` in the metrics). It is added to every response,
    a group whose label abstained included: such a group then learns length alone. lengths: (N, B, K)."""
    penalty = overlong_penalty(lengths, max_len, cache)
    return RewardOutput(scored.rewards + factor * penalty, {**scored.parts, "overlong": penalty}, scored.labels)


@reward_mode("none")
def no_mode_reward(batch: CohortBatch, cfg: RewardConfig) -> RewardOutput:
    """No reward of its own: the run's reward functions (reward.custom, CohortTrainer's reward_funcs) are all."""
    n, b, k = batch.shape
    return RewardOutput(torch.zeros(n, b, k), {}, [[None] * b for _ in range(n)])


REWARDS.register("co_rewarding_1")(RewardSpec(paired_reward, layout="two_views"))
REWARDS.register("co_rewarding_2")(RewardSpec(paired_reward, layout="ema_teacher"))
REWARDS.register("peers_ema")(RewardSpec(peers_ema_reward, layout="ema_teacher"))

"""The reward phase (the mode's reward, the reward functions', DAPO's overlong shaping, from the exchanged
fields) and dynamic sampling's rounds of fresh questions (algo.resample_zero_variance)."""

from __future__ import annotations

import torch

from vlm_corl.data.records import Example
from vlm_corl.distributed.exchange import exchange
from vlm_corl.training.monitor.metrics import zero_variance_frac
from vlm_corl.training.phases.render_ahead import RenderAhead
from vlm_corl.training.phases.rollout_phase import extract_phase, rollout_phase
from vlm_corl.training.rewards.dynamic_sampling import StepRollouts, resample, sub_shards
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput, add_overlong_penalty
from vlm_corl.training.rewards.reward_funcs import Scorers, add_function_rewards, function_rewards
from vlm_corl.training.run.setup import CohortRun
from vlm_corl.training.run.slots import owner


def reward_phase(
    run: CohortRun, batch: list[Example], exchanged: list[list], step: int
) -> tuple[CohortBatch, RewardOutput]:
    """The rewards of `batch` (the step's, or a round of dynamic sampling's) from its exchanged fields: the
    mode's, plus the reward functions', plus DAPO's overlong penalty (algo.overlong_penalty)."""
    cfg = run.cfg
    cohort = cohort_batch(run, batch, exchanged)
    scored = run.reward_spec.fn(cohort, cfg.reward)
    if run.reward_funcs:
        scorers = Scorers(trained_slots(run), run.world)
        values = function_rewards(run.reward_funcs, cohort, batch, run.specs, scorers, step + 1)
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
    are replaced by fresh ones, round by round (`vlm_corl.training.rewards.dynamic_sampling`); returns the step's
    rollouts and the metrics {resampled_groups, resample_rounds, zero_variance_left, zero_variance_frac_before:
    per slot, the share of its groups with equal rewards before the rounds}."""

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

    owners = [owner(s) for s in run.slots]
    before = [zero_variance_frac(r) for r in rolled.scored.rewards]
    rolled, counts = resample(rolled, trained_slots(run), run.cfg.algo.resample_max_rounds, again, run.shards, owners)
    return rolled, {**counts, "zero_variance_frac_before": before}


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

"""The log phase's rows: every member's update stats and every slot's rollout seconds and memory gathered from
the ranks, one metrics row per slot (rewards, agreement, categories, update stats, speed, memory) with the
collapse detector's flags, and the step's sampled questions for samples.jsonl."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vlm_corl.data.records import Example
from vlm_corl.planning.check import against_plan
from vlm_corl.training.monitor.category_metrics import category_step_stats, window_metrics
from vlm_corl.training.monitor.metrics import cohort_unanimity, member_metrics, pairwise_agreement, unanimity
from vlm_corl.training.monitor.samples import SampleSettings, sample_rows, samples_due
from vlm_corl.training.phases.phase_timer import PhaseTimer
from vlm_corl.training.rewards.dynamic_sampling import StepRollouts
from vlm_corl.training.rewards.modes import CohortBatch
from vlm_corl.training.run.checkpoint import latest_checkpoint
from vlm_corl.training.run.numerics import check_rollout_mismatch
from vlm_corl.training.run.setup import CohortRun

# the update stats each member's metrics row carries (members/update.py: policy_update, update_stats); docs/metrics.md
UPDATE_KEYS = (
    *("loss", "grad_norm", "lr", "nonfinite_skipped", "update_tokens", "compute_dtype"),
    *("clip_frac", "clip_frac_low", "clip_frac_high", "kl", "entropy"),
)


@dataclass
class StepOutcome:
    """What one step leaves for its metrics rows: the cohort batch and its rewards, the gold answers and
    categories of its questions (diagnostics only), response lengths, update stats, rollout seconds and memory."""

    step: int
    cohort: CohortBatch
    scored: object  # vlm_corl.training.rewards.modes.RewardOutput
    gold: list
    categories: list  # (B,) str | None
    lengths: list  # (N, B, K)
    updates: dict  # member id -> update stats
    rollout_s: dict  # slot id -> seconds
    memory: dict = field(default_factory=dict)  # slot id -> {prompt_cache_mb, peak_gb_<phase> (CUDA)}
    truncated: list | None = None  # (N, B, K) responses cut at rollout.max_new_tokens
    resampled: dict = field(default_factory=dict)  # algo.resample_zero_variance's counts (cohort-wide)


def categories(batch: list[Example], key: str | None) -> list[str | None]:
    """Each example's category (its metadata[logging.category_key], as a string), or None."""
    return [None if key is None or ex.metadata.get(key) is None else str(ex.metadata[key]) for ex in batch]


def _gather_step_facts(run: CohortRun, updates: dict, rollout_s: dict, timer: PhaseTimer) -> tuple[dict, dict, dict]:
    """Every member's update stats (from its first rank; identical on the others), each slot's rollout seconds
    (the slowest of its ranks), and each slot's memory (the largest of its ranks): its renderer's prompt cache
    (MB, host) and, on CUDA, the peak each phase so far allocated on its device (GB), on every rank, with the
    memory plan's peak for the rank (`plan_gb`) and the largest measured peak over it (`peak_over_plan`)."""
    mine = {
        s.id: {
            "prompt_cache_mb": s.renderer.cached_bytes / 2**20,
            **{f"peak_gb_{k}": v for k, v in timer.peaks.items()},
            **against_plan(run.plan, run.world.rank, timer.peaks),
        }
        for s in run.slots
    }
    updates_all, seconds, memory = {}, {}, {}
    parts = run.world.all_gather((updates, rollout_s, mine))
    for mid in {mid for part in parts for mid in part[0]}:
        updates_all[mid] = member_stats([part[0][mid] for part in parts if mid in part[0]])
    for part in parts:
        for sid, sec in part[1].items():
            seconds[sid] = max(seconds.get(sid, 0.0), sec)
        for sid, values in part[2].items():
            slot = memory.setdefault(sid, {})
            for k, v in values.items():
                slot[k] = max(slot.get(k, 0.0), v)
    return updates_all, seconds, memory


def member_stats(ranks: list[dict]) -> dict:
    """One member's update stats from each of its ranks (`update.policy_update`'s, all over the member's ranks
    already, equal on each) but the importance ratio's extremes, each rank's own: their min and max."""
    stats = dict(ranks[0])
    for key, pick in (("is_ratio_min", min), ("is_ratio_max", max)):
        values = [r[key] for r in ranks if r.get(key) is not None and math.isfinite(r[key])]
        if key in stats:
            stats[key] = pick(values) if values else None
    return stats


def overlong_metrics(truncated: list, n: int) -> dict:
    """Slot n's share of responses cut at the length budget rollout.max_new_tokens (`truncated_frac`; with
    algo.mask_truncated, those are the responses left out of the loss)."""
    flags = [t for group in truncated[n] for t in group]
    return {"truncated_frac": sum(flags) / max(len(flags), 1)}


def metrics_rows(run: CohortRun, o: StepOutcome) -> tuple[list[dict], list[dict]]:
    """One metrics row per slot (per member, in the usual layout), update stats on the member's first slot;
    and the collapse warnings first raised by these rows.

    Cohort-level diagnostics (unanimity) are the same in every row. With logging.category_key, each row also
    holds the step's per-category sums and their running means over logging.category_window steps
    (monitor/category_metrics.py). The collapse detector runs on the run so far (`run.collapse`) plus these,
    sets `collapse_flag`/`collapse_on` and logs a slot's first detections (vlm_corl.training.monitor.collapse)."""
    rows, reported = [], set()
    unanimous = cohort_unanimity(o.cohort, o.gold, run.cfg.reward.vote_threshold)
    shared = unanimity(unanimous)
    pairs = pairwise_agreement(o.cohort, run.cfg.reward.vote_threshold)
    for n, s in enumerate(run.specs):
        row = {"step": o.step, "member": s.id}
        row.update(member_metrics(n, o.cohort, o.scored, o.lengths[n], o.gold))
        row.update(pairs[n])
        row.update(shared)
        if any(c is not None for c in o.categories):
            row["category_stats"] = category_step_stats(n, o.cohort, o.scored, o.categories, o.gold, unanimous)
            mine = [r.get("category_stats") for r in run.collapse.recent.get(s.id, ())]
            row.update(window_metrics(mine + [row["category_stats"]]))
        stats = o.updates.get(s.member_id, {}) if s.member_id not in reported else {}
        reported.add(s.member_id)
        row.update({k: stats.get(k) for k in UPDATE_KEYS})
        row.update({k: v for k, v in stats.items() if k.startswith("is_")})  # algo.rollout_is mismatch
        row["tokens_per_s"] = sum(map(sum, o.lengths[n])) / o.rollout_s[s.id]
        if o.truncated is not None:
            row.update(overlong_metrics(o.truncated, n))
        row.update({k: v for k, v in o.resampled.items() if k != "zero_variance_frac_before"})
        if "zero_variance_frac_before" in o.resampled:  # one per slot (`dynamic_sampling.resample`)
            row["zero_variance_frac_before"] = o.resampled["zero_variance_frac_before"][n]
        row.update(o.memory.get(s.id, {}))
        rows.append(row)
    return rows, run.collapse.flag(rows)


@dataclass
class StepResult:
    """What a step's phases produced on this rank, for its log phase."""

    step: int  # 1-based
    rolled: StepRollouts  # the step's questions, rollouts, exchanged fields, rewards, rollout seconds
    cohort: CohortBatch
    advantages: list  # per slot, (B, K)
    updates: dict  # this rank's members' update stats
    resampled: dict = field(default_factory=dict)  # algo.resample_zero_variance's counts


def log_phase(run: CohortRun, timer: PhaseTimer, result: StepResult) -> tuple[list[dict], list[dict]]:
    """Every member's update stats, rollout seconds and memory from all ranks (`run.updates`: what the
    numerical guard reads, on every rank), the rollout guard (algo.rollout_is), then on world rank 0 the step's
    metrics rows and collapse warnings, and its sampled questions when logging.samples_every says so."""
    cfg, rolled = run.cfg, result.rolled
    updates, rollout_s, memory = _gather_step_facts(run, result.updates, rolled.rollout_s, timer)
    run.updates = updates
    if cfg.algo.rollout_is != "none":
        check_rollout_mismatch(result.step, updates, cfg.algo.rollout_is_max_abs_dlogp, latest_checkpoint(run.run_dir))
    if not run.world.is_main:
        return [], []
    batch, exchanged = rolled.batch, rolled.exchanged
    outcome = StepOutcome(
        result.step,
        result.cohort,
        rolled.scored,
        [ex.answer for ex in batch],
        categories(batch, run.category_key),
        exchanged[3],
        updates,
        rollout_s,
        memory,
        truncated=exchanged[6],
        resampled=result.resampled,
    )
    rows, warnings = metrics_rows(run, outcome)
    if samples_due(result.step, cfg.logging.samples_every):
        settings = SampleSettings(
            cfg.reward.mode,
            cfg.reward.vote_threshold,
            cfg.logging.samples_per_step,
            run.category_key,
            views=tuple(s.view for s in run.specs),
            styles=tuple(run.prompt_styles.get(s.member_id) for s in run.specs),
        )
        sampled = sample_rows(result.step, batch, result.cohort, rolled.scored, result.advantages, settings)
        run.sink.write_samples(sampled, result.step)
    return rows, warnings

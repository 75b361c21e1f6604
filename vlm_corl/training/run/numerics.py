"""The numerical guard: a member's non-finite losses, gradients, weights or logits never reach its weights or
a checkpoint, and a member that keeps diverging stops the run with one message.

- Update: `Member.step` skips an optimizer step whose loss or summed gradient norm is not finite (the member's
  ranks agree through the gradient reduction; DeepSpeed's optimizer does the same for the gradient norm) and
  reports it as `nonfinite_skipped` in the member's metrics row. `NonFiniteTracker` logs each skip once, naming
  the member, the step and what was not finite, and after `train.max_nonfinite_steps` consecutive skips of one
  member stops every rank alike (the facts come from the log phase's gather) with exit 3.
- Load and rollout: `vlm_corl.members.finite` refuses a model directory whose weights hold a NaN or an
  infinity (naming the member and the tensor), and names the member whose forward pass gave non-finite logits
  while sampling.
- Checkpoint: the replica checksum pass (`checkpoint_phase._check_replicas`) refuses to save non-finite weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from vlm_corl.training.run.guard import EXIT_STATUS

log = logging.getLogger("vlm_corl")


class NonFiniteStopped(Exception):
    """A member's updates stayed non-finite `train.max_nonfinite_steps` times in a row: the run stops (exit 3)."""

    exit_status = EXIT_STATUS


def not_finite(stats: dict) -> str:
    """What was not finite in a member's update stats: "loss nan", "gradient norm inf", or both."""
    parts = [f"{name} {stats[key]}" for key, name in (("loss", "loss"), ("grad_norm", "gradient norm"))
             if isinstance(stats.get(key), float) and not math.isfinite(stats[key])]  # fmt: skip
    return " and ".join(parts) or "a rank's loss"


@dataclass
class NonFiniteTracker:
    """Consecutive skipped steps per member (and the run's total per member, for summary.json), and the stop
    after `limit` in a row."""

    limit: int
    streaks: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)

    def restore(self, rows: list[dict]) -> None:
        """A resumed run's metrics rows so far (step order): the counts and the streaks they end with."""
        for row in rows:
            if row.get("nonfinite_skipped") is None:
                continue
            mid = row["member"]
            skipped = bool(row["nonfinite_skipped"])
            self.streaks[mid] = self.streaks.get(mid, 0) + 1 if skipped else 0
            self.total[mid] = self.total.get(mid, 0) + skipped

    def observe(self, step: int, updates: dict[str, dict], checkpoint: Path | None, report: bool) -> None:
        """Record step `step`'s update stats of every member (the same on every rank); raise NonFiniteStopped
        when a member reaches the limit. `report`: this rank logs (world rank 0)."""
        for mid, stats in updates.items():
            if not stats.get("nonfinite_skipped"):
                self.streaks[mid] = 0
                continue
            self.streaks[mid] = self.streaks.get(mid, 0) + 1
            self.total[mid] = self.total.get(mid, 0) + 1
            if report:
                log.warning(
                    "member %s, step %d: %s; its optimizer step was skipped (%d in a row, train.max_nonfinite_steps"
                    "=%d)", mid, step, not_finite(stats), self.streaks[mid], self.limit,
                )  # fmt: skip
            if self.streaks[mid] >= self.limit:
                resume = f"the last complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
                raise NonFiniteStopped(
                    f"numerical guard: member {mid!r} had a non-finite loss or gradient norm at {self.limit} "
                    f"consecutive steps (the last: step {step}, {not_finite(stats)}); its weights were never "
                    f"updated with them, and {resume}. Lower its learning rate (members[i].lr or train.lr) or "
                    "train.grad_clip, check its data, then resume"
                )


class RolloutMismatchStopped(Exception):
    """A member's rollout engine sampled from other probabilities than its policy's (algo.rollout_is_max_abs_dlogp):
    the run stops (exit 3) before the step's checkpoint."""

    exit_status = EXIT_STATUS


def check_rollout_mismatch(step: int, updates: dict[str, dict], limit: float, checkpoint: Path | None) -> None:
    """Raise RolloutMismatchStopped when a member's mean |log pi_train - log pi_rollout| per token at `step`
    (`is_abs_dlogp` of its update stats, the same on every rank) is over `limit` (0: never). Every step's
    rollout is the first after a sync, so this catches an engine serving weights the trainer never pushed (a
    woken engine whose weights were discarded, a sync that missed a tensor) at the step it first happens."""
    if not limit:
        return
    over = {mid: s["is_abs_dlogp"] for mid, s in updates.items() if s.get("is_abs_dlogp", 0.0) > limit}
    if not over:
        return
    mid, gap = max(over.items(), key=lambda kv: kv[1])
    kept = f"the last complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
    raise RolloutMismatchStopped(
        f"rollout guard: at step {step} member {mid!r}'s rollout engine gave its sampled tokens log-probs "
        f"{gap:.3g} nats per token away from its policy's (algo.rollout_is_max_abs_dlogp={limit:g}): the engine "
        f"serves other weights than the trainer's, so its rollouts are not the policy's. This step's update "
        f"was weighted by the off-policy correction and is not checkpointed; {kept}. Report it with the run's "
        "config; meanwhile, with vLLM sleep mode on, rollout.vllm.sleep_level: 1 keeps the engine's weights "
        "through the update (some families' level-2 wake-up is incomplete), and members[i].engine: hf rolls out "
        "from the trainer's own module"
    )

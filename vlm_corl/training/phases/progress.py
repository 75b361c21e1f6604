"""A run's progress where a person reads it: tqdm's bar on a terminal; in a log file (stderr not a terminal) a
plain line every ~5% of the steps (`progress_line`), not the bar's carriage-return frames."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

from vlm_corl.training.run.setup import CohortRun

log = logging.getLogger("vlm_corl")


class Progress:
    """The steps from `run.start` to train.max_steps, shown on world rank 0 when logging.progress is on."""

    def __init__(self, run: CohortRun):
        self.total, self.start = run.cfg.train.max_steps, run.start
        self.shown = run.cfg.logging.progress and run.world.is_main
        self.bar = tqdm(
            range(run.start, self.total),
            initial=run.start,
            total=self.total,
            disable=not (self.shown and sys.stderr.isatty()),
            desc="cohort",
            dynamic_ncols=True,
        )
        self.every, self.started = max(1, self.total // 20), time.perf_counter()

    def __iter__(self) -> Iterator[int]:
        return iter(self.bar)

    def show(self, step: int, learners: list[dict]) -> None:
        """After 0-based `step`: the learners' mean rewards on the bar, or in a log file a line every ~5%."""
        if learners:
            self.bar.set_postfix(reward=" ".join(f"{r['reward_mean']:.2f}" for r in learners))
        done = step + 1
        if self.shown and self.bar.disable and (done % self.every == 0 or done == self.total):
            seconds = (time.perf_counter() - self.started) / (done - self.start)
            log.info(progress_line(done, self.total, learners, seconds))


def progress_line(step: int, total: int, rows: list[dict], seconds_per_step: float) -> str:
    """A plain progress line for a log file: step, share done, each member's mean reward, time per step."""
    rewards = ", ".join(f"{r['member']} {r['reward_mean']:.3f}" for r in rows)
    return f"step {step}/{total} ({100 * step / total:.0f}%): reward {rewards or '-'}; {seconds_per_step:.2f} s/step"

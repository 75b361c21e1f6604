"""The Python API: `CohortTrainer(config, callbacks=[...]).train()`, exactly what `corl train` runs.

`corl train` (and `accelerate launch -m vlm_corl.train`, `torchrun -m vlm_corl.train`) builds a CohortTrainer from
its YAML file and calls `train()`, so the command and a script cannot drift apart; a script that builds one is
launched by accelerate or torchrun the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_corl.config import CohortConfig, check_registered, config_from_dict, load_config
from vlm_corl.config.loading import with_overrides
from vlm_corl.training.callbacks import EVENTS, CallbackFailed, Callbacks

__all__ = ["EVENTS", "CallbackFailed", "CohortTrainer"]


class CohortTrainer:
    """Train a cohort of models with label-free Co-RL rewards.

    config: a cohort YAML file's path, a dict of the same shape, or a `CohortConfig`; validated as `corl train`
        validates it (a `ConfigError` with the same text names every problem). `overrides` are dotted
        `key=value` strings, as on the command line.
    callbacks: objects with any of `on_train_begin()`, `on_step_end(step, metrics)` (one row per member, as in
        metrics.jsonl), `on_evaluate(step, results)` (the in-loop evaluation's rows), `on_save(step, path)` (the
        checkpoint directory) and `on_train_end(summary)`. They run on the main process (world rank 0). One that
        raises stops the run on every rank with `CallbackFailed`, naming it; the last checkpoint stays intact.

    `train()` returns the run's summary (also in RUN/summary.json), with `run_dir`.
    """

    def __init__(
        self,
        config: str | Path | dict[str, Any] | CohortConfig,
        callbacks: Sequence[object] | None = None,
        overrides: Sequence[str] = (),
    ):
        if isinstance(config, CohortConfig):
            if overrides:
                raise TypeError("overrides apply to a YAML file or a dict, not to a CohortConfig")
            self.config = config
        elif isinstance(config, dict):
            self.config = config_from_dict(with_overrides(copy.deepcopy(config), overrides))
        else:
            self.config = load_config(config, overrides)
        check_registered(self.config)
        self.callbacks = list(callbacks or [])
        Callbacks(self.callbacks, is_main=True)  # a callback with no known method is a TypeError now, not later

    def train(self) -> dict:
        """Run the training to train.max_steps (resuming where train.resume says) and return the summary."""
        import torch.distributed as dist

        from vlm_corl.members.engines import release_engines
        from vlm_corl.training.loop import run_cohort

        try:
            return run_cohort(self.config, self.callbacks)
        finally:
            release_engines()  # vLLM's groups first: its exit hooks would destroy groups that are gone
            if dist.is_initialized():
                dist.destroy_process_group()  # every group, DeepSpeed's member groups included

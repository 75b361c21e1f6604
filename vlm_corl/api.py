"""The Python API: `CohortTrainer(config, callbacks=[...]).train()`, exactly what `corl train` runs.

`corl train` (and `accelerate launch -m vlm_corl.train`, `torchrun -m vlm_corl.train`) builds a CohortTrainer from
its YAML file and calls `train()`, so the command and a script cannot drift apart; a script that builds one is
launched by accelerate or torchrun the same way.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vlm_corl.config import CohortConfig, ConfigError, check_registered, config_from_dict, load_config
from vlm_corl.config.loading import config_to_dict, read_raw_config, with_overrides
from vlm_corl.config.schema import DatasetConfig
from vlm_corl.training.rewards.reward_funcs import RewardFunctionFailed, run_reward_functions
from vlm_corl.training.run.callbacks import EVENTS, CallbackFailed, StopTraining, callback_list

__all__ = ["EVENTS", "CallbackFailed", "CohortTrainer", "RewardFunctionFailed", "StopTraining"]

_DEFAULT_TRAIN = dataclasses.asdict(DatasetConfig())
EVAL_DATASET = "eval_dataset"  # how evaluation rows and results name CohortTrainer's eval_dataset


class CohortTrainer:
    """Train a cohort of models with label-free Co-RL rewards: what `corl train` runs.

    config: a cohort YAML file's path, a dict of the same shape, or a `CohortConfig`; validated as `corl train`
        validates it (a `ConfigError` with the same text names every problem). `overrides` are dotted
        `key=value` strings, as on the command line.
    train_dataset: a `datasets.Dataset`, `datasets.IterableDataset` or list of dicts, instead of the config's
        `data.train` loader (`data.train.split/skip/limit` still apply). Columns default to `question`, `answer`
        (optional) and `image` (a PIL image, a path, bytes, or a list of them); `columns={"question": "problem"}`
        names others. Rows go through the loaders' checks: a bad row is skipped, counted and reported.
    eval_dataset: the same kinds, with answers; evaluated every `eval.every` steps beside `eval.benchmarks`
        (its rows are named "eval_dataset" in eval.jsonl). `columns` applies to both datasets.
    reward_funcs: a callable `fn(*, member, prompts, completions, answers, peer_answers, **columns)` returning
        one float (or None: abstain) per completion, an import string naming one as `reward.custom` does
        ("my_pkg.rewards:score"), or a list mixing both; their values, weighted by `reward_weights` (one number
        per function, a single number for a single function; default 1 each), are added to the `reward.mode`'s
        reward (`reward.mode: none`: they are the whole reward). See `vlm_corl.training.rewards.reward_funcs` for the
        arguments; a signature that cannot take the dataset's columns is refused before any model loads.
    callbacks: an object, or a list of them, with any of `on_train_begin()`, `on_step_end(step, metrics)` (one
        row per member, as in metrics.jsonl), `on_evaluate(step, results)` (the in-loop evaluation's rows),
        `on_save(step, path)` (the checkpoint directory) and `on_train_end(summary)`. They run on the main process
        (world rank 0). One that returns (or raises) `StopTraining(reason)` ends the run cleanly after that step
        (final checkpoint, summary.json's `stopped_by_callback`); one that raises anything else stops the run on
        every rank with `CallbackFailed`, naming it; the last checkpoint stays intact.

    A mistake in any argument is a `ConfigError` naming it (`reward_funcs[1]`, `reward_weights`, `callbacks`).

    `train()` returns the run's summary (also in RUN/summary.json), with `run_dir`.
    """

    def __init__(
        self,
        config: str | Path | dict[str, Any] | CohortConfig,
        train_dataset: object = None,
        eval_dataset: object = None,
        reward_funcs: Sequence[Callable | str] | Callable | str | None = None,
        reward_weights: Sequence[float] | float | None = None,
        callbacks: Sequence[object] | object | None = None,
        columns: Mapping[str, str] | None = None,
        overrides: Sequence[str] = (),
    ):
        if isinstance(config, CohortConfig) and overrides:
            raise TypeError("overrides apply to a YAML file or a dict, not to a CohortConfig")
        if train_dataset is None and eval_dataset is None:
            self.config = _validated(config, overrides)
        else:
            raw = _raw(config, overrides)
            if train_dataset is not None:
                _use_train_dataset(raw, train_dataset, columns, filled=isinstance(config, CohortConfig))
            if eval_dataset is not None:
                _use_eval_dataset(raw, eval_dataset, columns)
            self.config = config_from_dict(raw)
        check_registered(self.config)
        self.reward_funcs = run_reward_functions(self.config, reward_funcs, reward_weights)
        self.callbacks = callback_list(callbacks)  # one object or a list; a wrong one is refused now, not later

    def train(self) -> dict:
        """Run the training to train.max_steps (resuming where train.resume says) and return the summary. Returned
        or raised, the run gives back its memory and the process groups it created (a group made before it, by
        the script or accelerate, stays)."""
        from vlm_corl.training.loop import run_cohort

        return run_cohort(self.config, self.callbacks, self.reward_funcs)


def _validated(config, overrides: Sequence[str]) -> CohortConfig:
    if isinstance(config, CohortConfig):
        return config
    if isinstance(config, dict):
        return config_from_dict(with_overrides(copy.deepcopy(config), overrides))
    return load_config(config, overrides)


def _raw(config, overrides: Sequence[str]) -> dict:
    """The config as a mapping (overrides applied) that the datasets are written into before validation."""
    if isinstance(config, CohortConfig):
        return config_to_dict(config)
    if isinstance(config, dict):
        return with_overrides(copy.deepcopy(config), overrides)
    return read_raw_config(config, overrides)


def _use_train_dataset(raw: dict, dataset: object, columns: Mapping[str, str] | None, filled: bool) -> None:
    """data.train reads `dataset` (the "python" loader); a config that also names a data source (a loader, path
    or options written in it; for a `CohortConfig`, whose fields are all filled, ones other than the defaults)
    is refused."""
    from vlm_corl.data.python_data import LOADER, register_dataset

    data = raw.setdefault("data", {}) if isinstance(raw.get("data", {}), dict) else {}
    train = data.get("train") or {}
    if not isinstance(train, dict):
        train = {}
    named = [k for k in ("loader", "path", "options") if k in train and (not filled or train[k] != _DEFAULT_TRAIN[k])]
    if named:
        raise ConfigError(
            [
                f"data.train.{named[0]}: the training data would come from two places, train_dataset and the "
                f"config's data.train.{named[0]}; remove data.train.{named[0]} (data.train.split, skip and limit "
                "still apply to train_dataset)"
            ],
            [f"data.train.{named[0]}"],
        )
    options = register_dataset(dataset, columns, "train_dataset")
    data["train"] = {**train, "loader": LOADER, "path": None, "options": options}


def _use_eval_dataset(raw: dict, dataset: object, columns: Mapping[str, str] | None) -> None:
    """A benchmark over `dataset` (answers required), added to eval.benchmarks."""
    from vlm_corl.data.python_data import LOADER, register_dataset
    from vlm_corl.evaluation.scoring import Benchmark
    from vlm_corl.registry import BENCHMARKS

    options = register_dataset(dataset, columns, EVAL_DATASET)
    name = f"{EVAL_DATASET}@{options['dataset']}"
    bench = Benchmark(EVAL_DATASET, LOADER, "test", options={**options, "require_answer": True})
    if name not in BENCHMARKS.names():
        BENCHMARKS.register(name)(bench)
    ev = raw.setdefault("eval", {}) if isinstance(raw.get("eval", {}), dict) else {}
    if not ev.get("every"):
        raise ConfigError(
            ["eval.every: eval_dataset is evaluated every eval.every steps, which is 0 (off); set eval.every"],
            ["eval.every"],
        )
    ev["benchmarks"] = [*(ev.get("benchmarks") or []), name]

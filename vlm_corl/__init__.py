"""Co-RL: label-free reinforcement learning of model cohorts (the shared cohort core + vision-language parts)."""

import os as _os
import shutil as _shutil

__version__ = "0.1.0"

# DeepSpeed (imported by transformers/accelerate when installed) guesses its accelerator at import and, on a
# machine without one, prints a warning to stdout, which corrupts the JSON our commands print. Without an
# NVIDIA driver the answer is known: the CPU. A user's DS_ACCELERATOR always wins.
if _shutil.which("nvidia-smi") is None:
    _os.environ.setdefault("DS_ACCELERATOR", "cpu")


__all__ = ["CohortTrainer", "CallbackFailed", "RewardFunctionFailed", "StopTraining", "__version__"]


def __getattr__(name: str):
    """The public API, imported on first use (`from vlm_corl import CohortTrainer`): every command imports this
    package, and the API's imports need not slow them.

    CohortTrainer: train a cohort (vlm_corl.api.CohortTrainer; docs/python-api.md).
    CallbackFailed: a user callback raised; the run stopped, its last checkpoint intact.
    RewardFunctionFailed: a reward function raised or returned something unusable; the step stopped.
    StopTraining: returned (or raised) by a callback, ends the run cleanly after the current step.
    """
    if name in ("CohortTrainer", "CallbackFailed", "RewardFunctionFailed", "StopTraining"):
        from vlm_corl import api

        return getattr(api, name)
    raise AttributeError(f"module 'vlm_corl' has no attribute {name!r}")

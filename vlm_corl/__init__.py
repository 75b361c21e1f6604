"""Co-RL: label-free reinforcement learning of model cohorts (the shared cohort core + vision-language parts)."""

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import os as _os
import shutil as _shutil
import sys as _sys

__version__ = "0.1.0"

# DeepSpeed (imported by transformers/accelerate when installed) guesses its accelerator at import and, on a
# machine without one, prints a warning to stdout, which corrupts the JSON our commands print. Without an
# NVIDIA driver the answer is known: the CPU. A user's DS_ACCELERATOR always wins.
if _shutil.which("nvidia-smi") is None:
    _os.environ.setdefault("DS_ACCELERATOR", "cpu")


# The commands' module names before they moved into commands/ and models/: `python -m vlm_corl.plan ...` in a
# user's scripts and notes still runs the command (and `import vlm_corl.plan` gives the same module object).
# vlm_corl.train is a file of its own (train.py): launch scripts name it most.
MOVED = {
    "vlm_corl.preflight": "vlm_corl.commands.preflight",
    "vlm_corl.plan": "vlm_corl.commands.plan",
    "vlm_corl.eval": "vlm_corl.commands.eval",
    "vlm_corl.export": "vlm_corl.commands.export",
    "vlm_corl.report": "vlm_corl.commands.report",
    "vlm_corl.probe": "vlm_corl.commands.probe",
    "vlm_corl.demo": "vlm_corl.commands.demo",
    "vlm_corl.zoo": "vlm_corl.commands.zoo",
    "vlm_corl.warmstart": "vlm_corl.commands.warmstart",
    "vlm_corl.coverage": "vlm_corl.models.coverage",
}


# The training modules' paths before training/ was split into sub-rooms (and the preflight's work moved to its
# command's room): `from vlm_corl.training.callbacks import Callback` in a user's script still works, giving the
# same module object. vlm_corl.training.rewards is the rewards room itself, which answers for its old module.
RELOCATED = {
    "vlm_corl.training.render_ahead": "vlm_corl.training.phases.render_ahead",
    "vlm_corl.training.rollout_phase": "vlm_corl.training.phases.rollout_phase",
    "vlm_corl.training.reward_phase": "vlm_corl.training.phases.reward_phase",
    "vlm_corl.training.update_phase": "vlm_corl.training.phases.update_phase",
    "vlm_corl.training.step_metrics": "vlm_corl.training.phases.step_metrics",
    "vlm_corl.training.checkpoint_phase": "vlm_corl.training.phases.checkpoint_phase",
    "vlm_corl.training.eval_phase": "vlm_corl.training.phases.eval_phase",
    "vlm_corl.training.phase_timer": "vlm_corl.training.phases.phase_timer",
    "vlm_corl.training.progress": "vlm_corl.training.phases.progress",
    "vlm_corl.training.reward_funcs": "vlm_corl.training.rewards.reward_funcs",
    "vlm_corl.training.grpo": "vlm_corl.training.rewards.grpo",
    "vlm_corl.training.dynamic_sampling": "vlm_corl.training.rewards.dynamic_sampling",
    "vlm_corl.training.headroom": "vlm_corl.training.rewards.headroom",
    "vlm_corl.training.metrics": "vlm_corl.training.monitor.metrics",
    "vlm_corl.training.category_metrics": "vlm_corl.training.monitor.category_metrics",
    "vlm_corl.training.trackers": "vlm_corl.training.monitor.trackers",
    "vlm_corl.training.samples": "vlm_corl.training.monitor.samples",
    "vlm_corl.training.throughput": "vlm_corl.training.monitor.throughput",
    "vlm_corl.training.collapse": "vlm_corl.training.monitor.collapse",
    "vlm_corl.training.setup": "vlm_corl.training.run.setup",
    "vlm_corl.training.slots": "vlm_corl.training.run.slots",
    "vlm_corl.training.checkpoint": "vlm_corl.training.run.checkpoint",
    "vlm_corl.training.async_checkpoint": "vlm_corl.training.run.async_checkpoint",
    "vlm_corl.training.guard": "vlm_corl.training.run.guard",
    "vlm_corl.training.numerics": "vlm_corl.training.run.numerics",
    "vlm_corl.training.summary": "vlm_corl.training.run.summary",
    "vlm_corl.training.release": "vlm_corl.training.run.release",
    "vlm_corl.training.callbacks": "vlm_corl.training.run.callbacks",
    "vlm_corl.training.preflight_checks": "vlm_corl.commands.preflight_checks",
    "vlm_corl.training.preflight_watch": "vlm_corl.commands.preflight_watch",
}


_OLD_NAMES = {**MOVED, **RELOCATED}


class _MovedModules(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Finds an old name of MOVED or RELOCATED: imported, it is the new module itself; run with -m, the new
    module's code (runpy asks the loader for it)."""

    def find_spec(self, name, path=None, target=None):
        if name not in _OLD_NAMES:
            return None
        spec = _importlib_util.spec_from_loader(name, self, origin=_importlib_util.find_spec(_OLD_NAMES[name]).origin)
        spec.has_location = True  # runpy gives the code this __file__ (the demo finds its shipped bases by it)
        return spec

    def create_module(self, spec):
        module = _importlib.import_module(_OLD_NAMES[spec.name])
        spec.loader_state = module.__spec__  # importlib now gives the module the old name's spec: kept to undo it
        return module

    def exec_module(self, module):
        """Nothing to run (create_module returned the new module, already imported); the module gets its own
        spec back, so runpy and importlib find it under its own name as before."""
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, name):
        return _importlib_util.find_spec(_OLD_NAMES[name]).loader.get_code(_OLD_NAMES[name])


if not any(isinstance(finder, _MovedModules) for finder in _sys.meta_path):
    _sys.meta_path.append(_MovedModules())


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

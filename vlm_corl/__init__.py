"""Co-RL: label-free reinforcement learning of model cohorts (the shared cohort core + vision-language parts)."""

import os as _os
import shutil as _shutil

__version__ = "0.1.0"

# DeepSpeed (imported by transformers/accelerate when installed) guesses its accelerator at import and, on a
# machine without one, prints a warning to stdout, which corrupts the JSON our commands print. Without an
# NVIDIA driver the answer is known: the CPU. A user's DS_ACCELERATOR always wins.
if _shutil.which("nvidia-smi") is None:
    _os.environ.setdefault("DS_ACCELERATOR", "cpu")

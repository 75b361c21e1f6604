"""Helpers shared by the end-to-end tests: small cohort configs, reading a run's outputs, running a command through
`python -m`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def python_m(module: str, *args, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m module args...` in the repository (one OpenMP thread), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def cohort(tmp: Path, members: list[tuple[str, Path]], **sections) -> dict:
    """A cohort config dict: members + small, fast defaults; `sections` override whole sections."""
    cfg = {
        "output_dir": str(tmp / "run"),
        "members": [{"id": mid, "model": str(path)} for mid, path in members],
        "data": {"train": {"loader": "easyvqa", "limit": 64}, "batch_size": 4},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "train": {"max_steps": 2, "lr": 1e-3, "save_every": 0, "warmup_ratio": 0.0},
        "logging": {"report_to": [], "progress": False},
    }
    cfg.update(sections)
    return cfg


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Metrics fields that measure the machine and the placement (seconds, throughput, memory), not the training:
# left out where two runs' rows must be equal.
MEASURED = ("time_", "tokens_per_s", "prompt_cache_mb", "peak_gb_", "plan_gb", "peak_over_plan")


def trained_fields(rows: list[dict]) -> list[dict]:
    """Metrics rows without their MEASURED fields."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

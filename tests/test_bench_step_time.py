"""`bench/step_time.py` at its smallest size: it must run on main (it once broke unnoticed: a custom reward
that reads entropy never received it), and print the JSON its README documents."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_time_benchmark_runs_at_its_smallest_size(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "bench/step_time.py",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--prompts",
            "2",
            "--max-new-tokens",
            "4",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["member_step"]["median_step_s"] > 0 and out["members"] == 2
    assert out["P"] == 2 and out["K"] == 4

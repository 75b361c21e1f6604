#!/usr/bin/env python3
"""Step time of one 2-member cohort in 1 process vs 2 processes (one member each), on real easy-vqa data.

Prints ONE JSON object: the median cohort step in each layout, their ratio (target: 2 processes <= 0.6 x one
process on a 2-core machine) and per-phase medians. Both layouts run the real trainer (`python -m
vlm_corl.train`; 2 processes through `torch.distributed.run`, gloo) with one torch thread per process, so
the 2-process run uses both cores: one member rolls out and updates on each while the exchange crosses
between them. A step is `time_step` of metrics.jsonl (rank 0's wall time from sampling to logging, so it
includes waiting for the other rank); the first --warmup steps are left out. Layouts alternate for --rounds
rounds so machine noise hits both.

    python bench/scale.py                  # two tiny zoo members (Qwen2-VL, Mllama), 12 steps x 16 questions
    python bench/scale.py --size small     # the zoo's small preset (~1M parameters each)
    python bench/scale.py --size smoke     # seconds: checks the script runs (the default test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.6
SIZES = {  # zoo preset, steps, prompts per step, new tokens
    "smoke": ("tiny", 3, 2, 4),
    "tiny": ("tiny", 12, 16, 16),
    "small": ("small", 12, 16, 16),
}


def cohort_config(zoo: Path, out: Path, steps: int, batch: int, tokens: int) -> dict:
    return {
        "output_dir": str(out),
        "members": [{"id": "qwen", "model": str(zoo / "qwen2_vl")}, {"id": "llama", "model": str(zoo / "mllama")}],
        "data": {"train": {"loader": "easyvqa", "limit": max(256, 2 * batch)}, "batch_size": batch},
        "rollout": {"n": 4, "max_new_tokens": tokens},
        "reward": {"mode": "entropy"},  # dense rewards: every sequence is trained, as in a real run's worst case
        "train": {"max_steps": steps, "lr": 1e-4, "save_every": 0, "micro_batch_size": 4 * batch},
        "logging": {"report_to": [], "progress": False},
    }


def run_layout(cfg_path: Path, procs: int) -> list[dict]:
    """Train once in `procs` processes; returns rank 0's metrics rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    train = ["-m", "vlm_corl.train", "--config", str(cfg_path)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
    cmd = [sys.executable, *launcher, *train]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    out = Path(yaml.safe_load(cfg_path.read_text())["output_dir"])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_times(rows: list[dict], warmup: int) -> tuple[list[float], dict[str, list[float]]]:
    """Per-step wall seconds (one value per step) and per-phase seconds, after `warmup` steps."""
    first = {}
    for row in rows:
        first.setdefault(row["step"], row)  # every member's row of a step carries the step's times
    kept = [r for s, r in sorted(first.items()) if s > warmup]
    phases = {k[5:]: [r[k] for r in kept] for k in kept[0] if k.startswith("time_") and k != "time_step"}
    return [r["time_step"] for r in kept], phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two layouts")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="where zoo models and runs go (default: a temp dir)"
    )
    args = parser.parse_args()
    preset, steps, batch, tokens = SIZES[args.size]
    warmup = min(args.warmup, steps - 1)

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        zoo = work / f"zoo-{preset}"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "vlm_corl.zoo",
                "--out",
                str(zoo),
                "--size",
                preset,
                "--families",
                "qwen2_vl,mllama",
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        times: dict[int, list[float]] = {1: [], 2: []}
        phases: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
        started = time.perf_counter()
        for r in range(args.rounds):
            for procs in (1, 2):
                cfg = work / f"scale-{procs}p-{r}.yaml"
                cfg.write_text(yaml.safe_dump(cohort_config(zoo, work / f"run-{procs}p-{r}", steps, batch, tokens)))
                steps_s, by_phase = step_times(run_layout(cfg, procs), warmup)
                times[procs] += steps_s
                for k, v in by_phase.items():
                    phases[procs].setdefault(k, []).extend(v)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    print(
        json.dumps(
            {
                "size": args.size,
                "zoo_preset": preset,
                "steps": steps,
                "prompts_per_step": batch,
                "samples": 4,
                "max_new_tokens": tokens,
                "rounds": args.rounds,
                "cpus": os.cpu_count(),
                "one_process_step_s": round(one, 4),
                "two_process_step_s": round(two, 4),
                "ratio_two_vs_one": round(two / one, 3),
                "target_ratio": TARGET_RATIO,
                "meets_target": two / one <= TARGET_RATIO,
                "phase_median_s": {
                    f"{p}p": {k: round(statistics.median(v), 4) for k, v in phases[p].items()} for p in (1, 2)
                },
                "wall_s": round(time.perf_counter() - started, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

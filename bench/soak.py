#!/usr/bin/env python3
"""A long run that must not grow: a tiny 2-member cohort (Qwen2-VL + Mllama, easy-vqa, label-free `ring`
rewards) trains for --steps steps in this process, through the real loop (`run_cohort`, checkpoints every
--save-every steps), and every step is sampled: resident set (VmRSS), seconds, the renderers' prompt caches,
open file descriptors and threads.

Prints ONE JSON object: per window of --window steps the medians (RSS MB, seconds per step) and the last
values (prompt cache MB, open files, threads); `rss_growth` = median RSS of the last quarter over the second
quarter, minus 1 (target <= 0.10: the first quarter is warm-up, allocator pools and caches filling);
`ok` when the growth is within --max-growth (exit 1 otherwise). The open files and threads of the last sample
against the second quarter's first are reported beside it (`open_files_growth`, `threads_growth`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/soak.py --steps 3000     # ~10 min on one core
    OMP_NUM_THREADS=1 .venv/bin/python bench/soak.py --steps 200      # the default suite's run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def status(field: str) -> int:
    """A number from /proc/self/status (VmRSS in kB, Threads)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def sample(run) -> dict:
    return {
        "rss_mb": status("VmRSS") / 1024,
        "prompt_cache_mb": sum(s.renderer.cached_bytes for s in run.slots) / 2**20,
        "open_files": len(os.listdir("/proc/self/fd")),
        "threads": status("Threads"),
    }


def soak(steps: int, window: int, save_every: int, work: Path) -> dict:
    import torch

    import vlm_corl.training.loop as loop
    from vlm_corl.config import config_from_dict
    from vlm_corl.models.zoo import build_zoo

    torch.set_num_threads(1)
    zoo = build_zoo(work / "zoo", ["qwen2_vl", "mllama"], size="tiny")
    cfg = config_from_dict(
        {
            "output_dir": str(work / "run"),
            "members": [{"id": "qwen", "model": str(zoo["qwen2_vl"])}, {"id": "llama", "model": str(zoo["mllama"])}],
            "data": {"train": {"loader": "easyvqa", "limit": 256}, "batch_size": 4, "prompt_cache_mb": 64},
            "rollout": {"n": 2, "max_new_tokens": 8},
            "reward": {"mode": "ring"},
            "train": {"max_steps": steps, "lr": 1e-4, "save_every": save_every, "keep_last": 2},
            "logging": {"report_to": [], "progress": False},
        }
    )
    samples: list[dict] = []
    phases = loop.step_phases

    def observed(run, step, timer, renders):  # the real step, then one sample of the process
        start = time.perf_counter()
        out = phases(run, step, timer, renders)
        samples.append({"step": step + 1, "seconds": time.perf_counter() - start, **sample(run)})
        return out

    loop.step_phases = observed
    began = time.perf_counter()
    try:
        loop.run_cohort(cfg)
    finally:
        loop.step_phases = phases
    windows = []
    for i in range(0, len(samples), window):
        part = samples[i : i + window]
        windows.append(
            {
                "steps": [part[0]["step"], part[-1]["step"]],
                "rss_mb": round(statistics.median(s["rss_mb"] for s in part), 1),
                "seconds_per_step": round(statistics.median(s["seconds"] for s in part), 4),
                "prompt_cache_mb": round(part[-1]["prompt_cache_mb"], 2),
                "open_files": part[-1]["open_files"],
                "threads": part[-1]["threads"],
            }
        )
    q = len(samples) // 4
    second, last = samples[q : 2 * q], samples[3 * q :]
    growth = statistics.median(s["rss_mb"] for s in last) / statistics.median(s["rss_mb"] for s in second) - 1
    return {
        "steps": len(samples),
        "wall_s": round(time.perf_counter() - began, 1),
        "rss_growth": round(growth, 4),
        "seconds_per_step_growth": round(
            statistics.median(s["seconds"] for s in last) / statistics.median(s["seconds"] for s in second) - 1, 4
        ),
        "open_files_growth": last[-1]["open_files"] - second[0]["open_files"],
        "threads_growth": last[-1]["threads"] - second[0]["threads"],
        "windows": windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--window", type=int, default=100, help="steps per reported window")
    parser.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps")
    parser.add_argument("--max-growth", type=float, default=0.10, help="RSS growth allowed (last vs second quarter)")
    parser.add_argument("--out", help="work directory (default: a temporary one)")
    args = parser.parse_args()
    if args.steps < 8:
        parser.error("--steps must be at least 8 (four quarters of two steps)")
    logging.disable(logging.WARNING)
    work = Path(args.out or tempfile.mkdtemp(prefix="soak-"))
    stdout = os.dup(1)
    os.dup2(2, 1)  # libraries' prints go to stderr; only the JSON to stdout
    report = soak(args.steps, args.window, args.save_every, work)
    report["max_growth"] = args.max_growth
    report["ok"] = report["rss_growth"] <= args.max_growth
    os.write(stdout, (json.dumps(report, indent=1) + "\n").encode())
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()

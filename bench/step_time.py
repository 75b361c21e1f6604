#!/usr/bin/env python3
"""Step time of our cohort trainer on a tiny Qwen2-VL, optionally side by side with TRL's GRPOTrainer.

Prints ONE JSON object: median seconds per member step (a cohort of one) and per cohort step (N members), the
share of a member step spent outside rollout and update, and with --vs-trl TRL's step time on the same model
and batch (bench/trl_grpo_tiny.py, the anchor, run in the same invocation) and the ratios
ours / TRL per member step and cohort / (N x TRL). See bench/README.md.

    python bench/step_time.py --vs-trl                          # hidden 64, 2 layers
    python bench/step_time.py --vs-trl --hidden 256 --layers 4

Same model: the anchor builds (or reuses) its random Qwen2-VL + processor under --cache-dir, and our members
load that saved directory. Same batch: P prompts x K samples, at most --max-new-tokens each, the whole batch in
one forward/backward (micro_batch_size = P*K, as TRL's per-device batch), and by default (--data shapes) the
anchor's own coloured-shape images (64x64 px) and question, written to a JSONL folder our "jsonl" loader reads.
--prompt question (default) gives both trainers the same prompt tokens; --prompt native adds our answer-format
instruction, as real runs do (the anchor's toy tokenizer makes it ~4x longer). --data easyvqa: real easy-vqa
questions and images (also 64x64 px) instead of the anchor's shapes.

Our side runs the real loop (`run_cohort`) in this process. A step's time is the wall time between two
consecutive metrics writes, like TRL's between two `on_step_end` callbacks: every phase, logging included;
the one checkpoint (save_every=0: after the last step) is outside. Phase seconds come from metrics.jsonl.
Ours and TRL alternate for --rounds rounds so machine noise hits both; medians pool every timed step. CPU-time
ratios are printed too: with one thread, they discount time lost to other processes.

Reward: by default (dense) every response gets a distinct reward (-mean token entropy, the entropy baseline),
so no group has zero variance and our update trains all P*K sequences, as TRL's loss always does. With
--reward ring (real peer rewards; self_vote for the cohort of one) a random model's rewards are nearly all
equal, and our update skips zero-advantage sequences: faster, but not like for like.
One torch thread on both sides (a shared 2-core machine: two threads collapse under contention).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, here and in the TRL subprocess
for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
}.items():
    os.environ.setdefault(_k, _v)

import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ANCHOR = Path(__file__).resolve().parent / "trl_grpo_tiny.py"  # the team's TRL anchor, copied unchanged
TARGET_MEMBER_RATIO = 0.5  # our member step <= 0.5 x TRL's step
TARGET_OUTSIDE_SHARE = 0.05  # < 5% of a step outside rollout and update


def load_anchor(path: Path):
    spec = importlib.util.spec_from_file_location("trl_grpo_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anchor_model_dir(anchor, args) -> str:
    """The anchor's saved model directory for these dimensions (built by the anchor's own code if missing)."""
    ns = argparse.Namespace(
        hidden=args.hidden, layers=args.layers, vocab=args.vocab, vision_dim=args.vision_dim, cache_dir=args.cache_dir
    )
    _, _, path, _ = anchor.load_assets(ns)
    return path


def write_shapes(anchor, n: int, size: int, folder: Path) -> Path:
    """The anchor's dataset (same seed, same images, same question) as a JSONL file + PNG images."""
    data = anchor.make_dataset(n, size, seed=0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for i, row in enumerate(data):
            row["image"].save(folder / f"{i:05d}.png")
            question = row["prompt"][0]["content"]
            f.write(
                json.dumps(
                    {"id": f"shape-{i:05d}", "question": question, "image": f"{i:05d}.png", "answer": row["answer"]}
                )
                + "\n"
            )
    return folder / "train.jsonl"


def cohort_config(args, model_dir: str, data_file: str | None, n_members: int, out_dir: Path):
    from vlm_corl.config import config_from_dict

    reward = {"mode": "entropy"} if args.reward == "dense" else {"mode": args.reward}  # dense: -entropy
    if args.reward == "ring" and n_members == 1:
        reward = {"mode": "self_vote"}  # a cohort of one has no peer
    train = (
        {"loader": "jsonl", "path": data_file}
        if args.data == "shapes"
        else {"loader": "easyvqa", "split": "train", "limit": args.prompts * (args.warmup + args.steps)}
    )
    return config_from_dict(
        {
            "name": "bench",
            "output_dir": str(out_dir),
            "seed": 0,
            "members": [{"id": f"m{i}", "model": model_dir, "seed": i} for i in range(n_members)],
            "data": {"train": train, "batch_size": args.prompts, "shuffle": False},
            "rollout": {"n": args.k, "max_new_tokens": args.max_new_tokens},
            "reward": reward,
            "train": {
                "max_steps": args.warmup + args.steps,
                "lr": 1e-5,
                "micro_batch_size": args.prompts * args.k,
                "save_every": 0,
                "keep_last": 1,
            },
            "logging": {"progress": False},
        }
    )


class StepClock:
    """Wall-clock time at the end of each step's metrics write, like TRL's `on_step_end`: the time between two
    is one whole step of the real loop (every phase, logging included; the end-of-run checkpoint comes after
    the last write)."""

    def __enter__(self):
        from vlm_corl.training.monitor.metrics import MetricsSink

        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []  # process CPU time: with one thread, wall minus time lost to contention
        self._write = write = MetricsSink.write

        def timed_write(sink, rows):
            write(sink, rows)
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())

        MetricsSink.write = timed_write
        return self

    def __exit__(self, *exc):
        from vlm_corl.training.monitor.metrics import MetricsSink

        MetricsSink.write = self._write


def run_ours(args, model_dir: str, data_file: str | None, n_members: int, out_dir: Path) -> dict:
    """Train a cohort of n_members through `run_cohort`: per-step wall time and the phases of metrics.jsonl."""
    from vlm_corl.config import check_registered
    from vlm_corl.training.loop import run_cohort

    cfg = cohort_config(args, model_dir, data_file, n_members, out_dir)
    check_registered(cfg)
    with StepClock() as clock:
        run_cohort(cfg)
    phases: dict[int, dict] = {}
    lengths: dict[int, list[float]] = {}
    for line in open(out_dir / "metrics.jsonl"):
        row = json.loads(line)
        phases[row["step"]] = {k[5:]: v for k, v in row.items() if k.startswith("time_") and k != "time_step"}
        lengths.setdefault(row["step"], []).append(row["response_len"])
    steps = sorted(phases)[args.warmup :]
    walls = [b - a for a, b in zip(clock.stamps[args.warmup - 1 :], clock.stamps[args.warmup :])]
    cpu = [b - a for a, b in zip(clock.cpu_stamps[args.warmup - 1 :], clock.cpu_stamps[args.warmup :])]
    return {
        "wall": walls,
        "cpu": cpu,
        "phases": [phases[s] for s in steps],
        "response_len": [x for s in steps for x in lengths[s]],
    }


def run_trl(args, out: Path) -> dict:
    cmd = [
        args.trl_python,
        str(args.anchor),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--prompts-per-step",
        str(args.prompts),
        "--generations",
        str(args.k),
        "--max-completion",
        str(args.max_new_tokens),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--vocab",
        str(args.vocab),
        "--vision-dim",
        str(args.vision_dim),
        "--cache-dir",
        args.cache_dir,
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def prompt_tokens(model_dir: str, data_file: str | None, args) -> tuple[int, int]:
    """(all tokens, image tokens) of our first rendered prompt."""
    from vlm_corl.config import MemberConfig
    from vlm_corl.members.member import load_member
    from vlm_corl.members.render import Renderer
    from vlm_corl.training.run.setup import load_training_examples

    cfg = cohort_config(args, model_dir, data_file, 1, Path("."))
    member = load_member(MemberConfig(id="probe", model=model_dir))
    example = load_training_examples(cfg.data.train)[0][0]
    ids = Renderer(member, "original", cfg.data.max_image_pixels, 10**6)(example).inputs["input_ids"]
    return ids.shape[1], int((ids == member.model.config.image_token_id).sum())


def med(values) -> float:
    return round(statistics.median(values), 4)


def summarise(runs: list[dict]) -> dict:
    walls = [w for r in runs for w in r["wall"]]
    phases = [p for r in runs for p in r["phases"]]
    outside = [1 - (p["rollout"] + p["update"]) / w for r in runs for w, p in zip(r["wall"], r["phases"])]
    names = sorted({k for p in phases for k in p})
    return {
        "median_step_s": med(walls),
        "run_median_step_s": [med(r["wall"]) for r in runs],
        "min_step_s": round(min(walls), 4),
        "max_step_s": round(max(walls), 4),
        "median_step_cpu_s": med([c for r in runs for c in r["cpu"]]),
        "cpu_util": round(sum(c for r in runs for c in r["cpu"]) / sum(walls), 2),
        "median_phase_s": {k: med([p.get(k, 0.0) for p in phases]) for k in names},
        "median_unphased_s": med([w - sum(p.values()) for r in runs for w, p in zip(r["wall"], r["phases"])]),
        "outside_rollout_update_share": round(statistics.median(outside), 4),
        "mean_response_len": round(statistics.fmean(x for r in runs for x in r["response_len"]), 2),
        "timed_steps": len(walls),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, choices=[64, 256], default=64, help="anchor model width")
    ap.add_argument("--layers", type=int, default=2, help="anchor model depth (use 4 with --hidden 256)")
    ap.add_argument("--members", type=int, default=2, help="N: members of the cohort timed for the cohort step")
    ap.add_argument("--prompts", type=int, default=8, help="P: prompts per step")
    ap.add_argument("--k", type=int, default=4, help="K: samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of (ours N=1, TRL, ours N=members), so noise hits both sides alike",
    )
    ap.add_argument(
        "--data",
        choices=["shapes", "easyvqa"],
        default="shapes",
        help="shapes: the anchor's own images and question; easyvqa: real easy-vqa (64x64 images)",
    )
    ap.add_argument(
        "--prompt",
        choices=["question", "native"],
        default="question",
        help="question: the bare question, token for token TRL's prompt; native: plus our answer-format "
        "instruction (answer_tags), which this toy tokenizer makes ~4x longer",
    )
    ap.add_argument(
        "--reward",
        choices=["dense", "ring"],
        default="dense",
        help="dense: every response trained (like-for-like with TRL); ring: real peer rewards",
    )
    ap.add_argument("--vs-trl", action="store_true", help="also time TRL's GRPOTrainer (the anchor) side by side")
    ap.add_argument("--anchor", type=Path, default=ANCHOR, help="path of trl_grpo_tiny.py")
    ap.add_argument("--trl-python", default=sys.executable, help="python with trl installed (default: this one)")
    ap.add_argument("--cache-dir", default="/tmp/trl_grpo_tiny_cache", help="the anchor's model cache")
    ap.add_argument("--vocab", type=int, default=1024, help="anchor tokenizer vocab (as the anchor)")
    ap.add_argument("--vision-dim", type=int, default=32, help="anchor vision width (as the anchor)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args()
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (a step's wall time runs from the previous step's end)")

    torch.set_num_threads(1)
    logging.disable(logging.INFO)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()

    anchor = load_anchor(args.anchor)
    if args.prompt == "question":
        from vlm_corl.members import render

        # Bench only: the member's prompt style becomes the bare question, so both trainers see the same tokens.
        render.PROMPT_STYLES = {style: "{question}" for style in render.PROMPT_STYLES}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        tmp = Path(tmp)
        model_dir = anchor_model_dir(anchor, args)
        data_file = None
        if args.data == "shapes":
            data_file = str(write_shapes(anchor, args.prompts * (args.warmup + args.steps), 64, tmp / "shapes"))
        member_runs, cohort_runs, trl_runs = [], [], []
        t0 = time.perf_counter()
        for r in range(args.rounds):
            member_runs.append(run_ours(args, model_dir, data_file, 1, tmp / f"ours1_{r}"))
            if args.vs_trl:
                trl_runs.append(run_trl(args, tmp / f"trl_{r}.json"))
            cohort_runs.append(run_ours(args, model_dir, data_file, args.members, tmp / f"oursN_{r}"))
        wall_s = time.perf_counter() - t0
        ours_prompt_tokens, ours_image_tokens = prompt_tokens(model_dir, data_file, args)

    member = summarise(member_runs)
    cohort = summarise(cohort_runs)
    result = {
        "model": model_dir,
        "hidden": args.hidden,
        "layers": args.layers,
        "P": args.prompts,
        "K": args.k,
        "max_new_tokens": args.max_new_tokens,
        "members": args.members,
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "warmup": args.warmup,
        "torch_threads": torch.get_num_threads(),
        "data": (
            "the anchor's coloured shapes, 64x64 px, its question"
            if args.data == "shapes"
            else "easy-vqa train, 64x64 px images"
        ),
        "prompt": args.prompt,
        "reward": args.reward,
        "prompt_tokens": ours_prompt_tokens,
        "image_tokens": ours_image_tokens,
        "member_step": member,
        "cohort_step": cohort,
        "member_step_s": member["median_step_s"],
        "cohort_step_s": cohort["median_step_s"],
        "outside_share": member["outside_rollout_update_share"],
        "outside_share_target": TARGET_OUTSIDE_SHARE,
    }
    if args.vs_trl:
        trl_steps = [s for t in trl_runs for s in t["step_s_all"][args.warmup :]]
        trl_step = med(trl_steps)
        result["trl"] = {
            "median_step_s": trl_step,
            "round_median_step_s": [t["median_step_s"] for t in trl_runs],
            "median_step_cpu_s": med([t["median_step_cpu_s"] for t in trl_runs]),
            "median_generate_s": med([t["median_generate_s"] for t in trl_runs]),
            "mean_completion_len": round(statistics.fmean(t["mean_completion_len"] for t in trl_runs), 2),
            "prompt_tokens": trl_runs[0]["prompt_tokens"],
            "image_tokens": trl_runs[0]["image_tokens"],
            "cpu_util": [t["cpu_util"] for t in trl_runs],
            "trl_version": trl_runs[0]["trl_version"],
        }
        result["trl_step_s"] = trl_step
        result["ratio_member_vs_trl"] = round(member["median_step_s"] / trl_step, 3)
        result["ratio_cohort_vs_N_trl"] = round(cohort["median_step_s"] / (args.members * trl_step), 3)
        # The same ratios in process CPU time, which machine contention inflates less than wall time.
        trl_cpu = result["trl"]["median_step_cpu_s"]
        result["cpu_ratio_member_vs_trl"] = round(member["median_step_cpu_s"] / trl_cpu, 3)
        result["cpu_ratio_cohort_vs_N_trl"] = round(cohort["median_step_cpu_s"] / (args.members * trl_cpu), 3)
        result["ratio_target"] = TARGET_MEMBER_RATIO
        result["meets_targets"] = {
            "member": result["ratio_member_vs_trl"] <= TARGET_MEMBER_RATIO,
            "cohort": result["ratio_cohort_vs_N_trl"] <= TARGET_MEMBER_RATIO,
            "outside_share": member["outside_rollout_update_share"] < TARGET_OUTSIDE_SHARE,
        }
    result["wall_s"] = round(wall_s, 1)
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The memory plan (vlm_corl.planning) against what a real run allocates, on CPU: states, activations, ZeRO's step.

For each zoo size and update (plain data parallel, ZeRO-2, ZeRO-3 on DeepSpeed's CPU accelerator), a 2-member
cohort (Qwen2-VL and Mllama, both on every rank, hosted in turn) is launched on --processes gloo ranks with
torchrun; each rank sets the run up (`training.setup.start_run`: members, optimizers, DeepSpeed engines) and
runs one training step, then measures:
- states: every tensor alive in the process (gc), storages counted once, less the renderer's prompt cache,
  right after an optimizer step (the largest over the step's members), against the plan's states for the rank
  (`RankPlan.states_bytes`: weights, gradients, optimizer, full copies, DeepSpeed's buckets);
- activations: the bytes autograd saved for the backward in one micro-batch (saved_tensors_hooks, parameters
  excluded), against the plan's activation and logits estimate at the step's real shapes (its longest prompt and
  response, its images' patches), not at the config's upper bounds;
- the ZeRO optimizer step's transient: the peak of the bytes allocated during each DeepSpeed member's
  `optimizer.step()` over what was there when it began (torch.profiler's CPU memory events), through the end of
  the client AdamW's step (not the all-gather of the updated weights after it: gloo's CPU all-gather allocates
  full-size buffers NCCL's, in place, does not), against the plan's `step_flat_gradients` (the step's flat fp32
  copy of the gradient partition: an upper bound, a partition of one tensor is flattened without a copy).
Prints ONE JSON object: per case and rank, measured, planned and their ratio.

    python bench/plan_check.py                            # tiny and small, dp/zero2/zero3, 2 processes (~5 min)
    python bench/plan_check.py --sizes tiny --updates dp,zero2  # the default suite's smallest run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = {"dp": None, "zero2": "configs/deepspeed/zero2.json", "zero3": "configs/deepspeed/zero3.json"}
TOLERANCE = 0.15  # the bound on the states part


def cohort_yaml(zoo: Path, size: str, update: str, out: Path, processes: int) -> dict:
    suffix = "" if size == "tiny" else f"-{size}"
    members = [
        {"id": fam, "model": str(zoo / f"{fam}{suffix}"), "ranks": list(range(processes))}
        for fam in ("qwen2_vl", "mllama")
    ]
    return {
        "name": f"plan-{size}-{update}",
        "output_dir": str(out),
        "members": members,
        "data": {"train": {"loader": "easyvqa", "limit": 64}, "batch_size": 2 * processes},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "reward": {"mode": "entropy"},  # differs on every response: every sequence trains
        "train": {
            "max_steps": 1,
            "save_every": 0,
            "micro_batch_size": 2,
            "deepspeed": DEEPSPEED[update],
            "check_memory": "off",
        },
        "logging": {"report_to": [], "progress": False},
    }


def launcher(args) -> dict:
    import yaml

    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    zoo = Path(args.zoo) if args.zoo else work / "zoo"
    report = {"processes": args.processes, "tolerance": TOLERANCE, "cases": {}}
    for size in args.sizes.split(","):
        if not args.zoo:
            subprocess.run(
                [sys.executable, "-m", "vlm_corl.zoo", "--out", str(zoo), "--size", size, "--families",
                 "qwen2_vl,mllama"],
                check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        for update in args.updates.split(","):
            case = f"{size}/{update}"
            cfg_path = work / f"{size}-{update}.yaml"
            cfg_path.write_text(
                yaml.safe_dump(cohort_yaml(zoo, size, update, work / f"run-{size}-{update}", args.processes))
            )
            out = work / f"{size}-{update}.json"
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}",
                 str(Path(__file__).resolve()), "--worker", str(cfg_path), str(out)],
                cwd=ROOT, capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode != 0:  # the workers' own error lines, not torchrun's report
                lines = [x for x in proc.stderr.splitlines() if "Error" in x and "ChildFailedError" not in x]
                report["cases"][case] = {"error": "\n".join(lines[-4:]) or proc.stderr[-3000:]}
                continue
            ranks = [json.loads(line) for line in out.read_text().splitlines()]
            report["cases"][case] = {"seconds": round(time.perf_counter() - start, 1), "ranks": ranks}
    states = [r["states_ratio"] for c in report["cases"].values() for r in c.get("ranks", [])]
    report["states_within_tolerance"] = bool(states) and all(abs(x - 1) <= TOLERANCE for x in states)
    steps = [s["ratio"] for c in report["cases"].values() for r in c.get("ranks", []) for s in r["zero_step"].values()]
    report["zero_step_within_plan"] = all(x is not None and x <= 1 + TOLERANCE for x in steps)
    report["errors"] = [k for k, c in report["cases"].items() if "error" in c]
    return report


class SavedForBackward:
    """Bytes autograd saves for the backward per forward (parameters excluded), the largest of the step's."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.current, self.peak, self.seen = exclude, 0, 0, set()
        self.in_backward = False

    def pack(self, t):
        import torch

        if self.in_backward:  # a new forward after a backward: the next micro-batch
            self.current, self.seen, self.in_backward = 0, set(), False
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = t.untyped_storage().data_ptr()
            if key not in self.exclude and key not in self.seen:
                self.seen.add(key)
                self.current += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.current)
        return t

    def unpack(self, t):
        self.in_backward = True
        return t


def live_storages(skip: set[int]) -> dict[int, int]:
    """{storage pointer: bytes} of every tensor alive in the process (each storage once), less `skip`."""
    import torch

    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except RuntimeError:
                continue
            if storage.data_ptr() and storage.data_ptr() not in skip:
                found[storage.data_ptr()] = storage.nbytes()
    return found


class StepPeaks:
    """Each DeepSpeed member's optimizer-step transient: the peak of the CPU bytes allocated during its ZeRO
    optimizer's `step()` over what was allocated when it began, through the client AdamW's step (torch.profiler's
    memory events: an op's own allocations at its start, frees where they happen)."""

    def __init__(self, members):
        self.peaks: dict[str, int] = {}
        for m in members:
            if getattr(m, "deepspeed", None) is not None:
                self._wrap(m.id, m.deepspeed.optimizer)

    def _wrap(self, member_id: str, optimizer) -> None:
        from torch.profiler import ProfilerActivity, profile

        step = optimizer.step

        def profiled(*args, **kwargs):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = step(*args, **kwargs)
            events = sorted(prof.events(), key=lambda e: e.time_range.start)
            # through the client AdamW's step (the flatten before it, its temporaries), not the all-gather after
            end = max((e.time_range.end for e in events if e.name.startswith("Optimizer.step#")), default=float("inf"))
            running = peak = 0
            for event in (e for e in events if e.time_range.start <= end):
                running += event.self_cpu_memory_usage
                peak = max(peak, running)
            self.peaks[member_id] = max(self.peaks.get(member_id, 0), peak)
            return out

        optimizer.step = profiled


def worker(cfg_path: str, out: str) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from vlm_corl.config import load_config
    from vlm_corl.planning.cohort import STATES, Hardware, plan_cohort
    from vlm_corl.training.loop import step_phases
    from vlm_corl.training.phases.phase_timer import PhaseTimer
    from vlm_corl.training.phases.render_ahead import RenderAhead
    from vlm_corl.training.run.setup import start_run

    cfg = load_config(cfg_path)
    run = start_run(cfg)
    params = {p.untyped_storage().data_ptr() for m in run.members for p in m.model.parameters()}
    saved = SavedForBackward(params)
    step_peaks = StepPeaks(run.members)
    renders = RenderAhead(run)
    at_steps = []  # live tensor bytes right after each optimizer step (gradients, moments and buckets all there)

    def after_step(optimizer, args, kwargs) -> None:
        cache = {
            t.untyped_storage().data_ptr()
            for s in run.slots
            for p in s.renderer.cached_prompts()
            for t in p.inputs.values()
            if isinstance(t, torch.Tensor)
        }
        at_steps.append(sum(live_storages(cache).values()))

    hook = register_optimizer_step_post_hook(after_step)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step_phases(run, 0, PhaseTimer(run.world, 0), renders)
    hook.remove()
    renders.close()
    measured = max(at_steps)
    plan = plan_cohort(cfg, Hardware(run.world.size, 24e9, cuda=False))
    mine = next(r for r in plan.ranks if r.rank == run.world.rank)
    planned = mine.states_bytes()
    buckets = sum(it.bytes for it in mine.items if it.part == "ds_buckets")
    prompt_tokens = max(int(p.inputs["input_ids"].shape[-1]) for s in run.slots for p in s.renderer.cached_prompts())
    estimates = activation_estimates(run, prompt_tokens)
    row = {
        "rank": run.world.rank,
        "states_measured_mb": round(measured / 2**20, 2),
        "states_planned_mb": round(planned / 2**20, 2),
        "states_ratio": round(measured / planned, 3),
        # DeepSpeed's buckets are fixed sizes (200 MB each under our presets): the rest, compared on its own
        "states_ratio_without_buckets": round((measured - buckets) / (planned - buckets), 3),
        "planned_parts_mb": {
            f"{it.member}.{it.part}": round(it.bytes / 2**20, 2) for it in mine.items if it.part in STATES
        },  # fmt: skip
        "saved_for_backward_mb": round(saved.peak / 2**20, 3),
        "activation_estimate_mb": round(max(estimates.values()) / 2**20, 3),
        "activation_ratio": round(saved.peak / max(estimates.values()), 3),
        "prompt_tokens": prompt_tokens,
        "zero_step": zero_step(mine, step_peaks.peaks),
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    run.world.barrier()


def activation_estimates(run, prompt_tokens: int) -> dict[str, float]:
    """{member: the plan's activation and logits estimate} at this step's real shapes: its longest prompt
    (`prompt_tokens`), the responses' length, each member's images' patches (fp32, no checkpointing)."""
    from vlm_corl.planning import estimates as est
    from vlm_corl.planning.shapes import cohort_shapes

    cfg, out = run.cfg, {}
    shapes = cohort_shapes(m.cfg for m in run.members)  # each model read once, as a plan does
    for m in run.members:
        shape = shapes[m.id]
        micro = cfg.train.micro_batch_size
        tokens = micro * (prompt_tokens + cfg.rollout.max_new_tokens)
        acts = est.activation_bytes(shape, tokens, micro * est_patches(m, shape, run), 4, False)
        logits = est.logits_bytes(micro, cfg.rollout.max_new_tokens, shape.vocab, 4) - est.CHUNK_BYTES
        out[m.id] = sum(acts.values()) + logits
    return out


def zero_step(rank_plan, peaks: dict[str, int]) -> dict[str, dict]:
    """Per DeepSpeed member on this rank: the measured step transient against the plan's `step_flat_gradients`."""
    out = {}
    for member, peak in peaks.items():
        flat = sum(it.bytes for it in rank_plan.items if it.member == member and it.part == "step_flat_gradients")
        out[member] = {
            "measured_mb": round(peak / 2**20, 3),
            "planned_mb": round(flat / 2**20, 3),
            "ratio": round(peak / flat, 3) if flat else None,
        }
    return out


def est_patches(member, shape, run) -> int:
    """Vision-tower positions of the largest image the member (of `shape`) was given this step: Qwen-VL's
    pixel_values rows (one per patch), else the tower's fixed count (0 for text members)."""
    if shape.fixed_patches or not shape.is_vision:
        return shape.fixed_patches
    rows = [p.inputs["pixel_values"].shape[0] for s in run.slots if s.member is member
            for p in s.renderer.cached_prompts() if "pixel_values" in p.inputs]  # fmt: skip
    return max(rows, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--updates", default="dp,zero2,zero3")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--zoo", help="a zoo directory already built (tiny and -small members)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    print(json.dumps(launcher(args), indent=1))


if __name__ == "__main__":
    main()

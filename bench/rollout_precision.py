#!/usr/bin/env python3
"""How HF rollouts should compute over a trainable member's fp32 master weights: measured, printed as JSON.

    python bench/rollout_precision.py --model DIR [--prompts 8] [--n 4] [--max-new-tokens 64] [--rounds 3]

Four ways to sample the same prompts with the HF engine's decoder (`vlm_corl.members.engines.hf.sample`):
- `fp32`: no autocast (what rollouts did before: 2x the bytes, no bf16 tensor cores);
- `autocast_inference_mode`: bf16 autocast under torch.inference_mode, where autocast cannot cache its casts:
  every weight is cast again at every decoded token;
- `autocast_cached` (the engine's choice): bf16 autocast under torch.no_grad, where autocast caches the cast
  of every leaf weight for the whole rollout: each weight is cast once per rollout, and the bf16 copies live only
  while the rollout runs (no second model kept between steps, nothing to sync);
- `bf16_copy`: a persistent bf16 copy of the module (2 bytes per parameter more, all the time, and a copy to
  refresh after every update).
Per mode: median tokens/s over --rounds calls, weight casts per call (counted on one call), and the peak memory
of a call above what was allocated before it (CUDA: max_memory_allocated; CPU: not measured). On a CPU without
bf16 kernels the timings say little; the cast counts and memory are what carries over to a GPU, where
bench/gpu_check.sh runs the same measurement at real size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vlm_corl.config import MemberConfig  # noqa: E402
from vlm_corl.data.loaders import load_examples  # noqa: E402
from vlm_corl.members.engines.hf import Decoding, Endings, sample  # noqa: E402
from vlm_corl.members.member import load_member  # noqa: E402
from vlm_corl.members.render import Renderer  # noqa: E402
from vlm_corl.members.rollout import SamplingParams  # noqa: E402

MODES = ("fp32", "autocast_inference_mode", "autocast_cached", "bf16_copy")


class CastCounter(TorchDispatchMode):
    """Counts dtype conversions of tensors shaped like one of the model's weight matrices."""

    def __init__(self, shapes: set):
        super().__init__()
        self.shapes, self.casts = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and tuple(args[0].shape) in self.shapes:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def contexts(mode: str, device: torch.device):
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode.startswith("autocast"))
    grad = torch.inference_mode() if mode == "autocast_inference_mode" else torch.no_grad()
    return autocast, grad


def run(model, prompts, params, policy, eos, tok, mode, device, counter=None):
    autocast, grad = contexts(mode, device)
    with autocast, grad, counter if counter is not None else contextlib.nullcontext():
        # the plain decoding loop (static cache off), whose casts this counts; gpu_check's decode_sync times the
        # static one
        tokens, _, _, _ = sample(model, [p.inputs for p in prompts], params, policy, Endings(eos, tok), Decoding("off"))
    return sum(len(t) for t in tokens)


def main(argv=None) -> int:
    print(json.dumps(measure(argv)))
    return 0


def measure(argv=None) -> dict:
    """The measurement (see the module docstring) for command-line arguments `argv`, as a dict."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="member directory (a zoo member, a real-size random one)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    member = load_member(MemberConfig(id="bench", model=args.model))  # trainable: fp32 masters
    device = member.device
    render = Renderer(member, "original", 10**6, 1 << 30)
    prompts = [render(ex) for ex in load_examples("easyvqa", split="test", limit=args.prompts).examples]
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    policy, eos, tok = member.policy(1.0), member.eos_token_ids, member.tokenizer
    shapes = {tuple(p.shape) for p in member.model.parameters() if p.dim() == 2}
    result = {"model": args.model, "device": str(device), "prompts": len(prompts), "n": args.n}
    result["max_new_tokens"] = args.max_new_tokens
    result["parameters"] = sum(p.numel() for p in member.model.parameters())
    for mode in args.modes.split(","):
        model = member.model.eval()
        if mode == "bf16_copy":
            model = copy.deepcopy(member.model).to(torch.bfloat16).eval()
        run(model, prompts[:2], params, policy, eos, tok, mode, device)  # warm-up
        counter = CastCounter(shapes)
        run(model, prompts[:2], params, policy, eos, tok, mode, device, counter)
        rates, peaks = [], []
        for r in range(args.rounds):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            start = time.perf_counter()
            n_tokens = run(
                model, prompts, SamplingParams(**{**params.__dict__, "seed": r}), policy, eos, tok, mode, device
            )
            if device.type == "cuda":
                torch.cuda.synchronize()
                peaks.append((torch.cuda.max_memory_allocated() - before) / 2**30)
            rates.append(n_tokens / (time.perf_counter() - start))
        result[mode] = {
            "tokens_per_s": statistics.median(rates),
            "weight_casts_per_call": counter.casts,
            "extra_model_gb": round(sum(p.numel() * 2 for p in model.parameters()) / 2**30, 4)
            if mode == "bf16_copy"
            else 0.0,
            "peak_above_start_gb": round(statistics.median(peaks), 3) if peaks else None,
        }
        del model
    return result


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Rollout throughput: the HF engine vs the vLLM engine on the same member, prompts and sampling (JSON).

    python bench/rollout.py --model DIR [--prompts 16] [--n 4] [--max-new-tokens 64] [--rounds 3] [--engines hf,vllm]

One member (a zoo member or any HF model directory), one batch of text prompts (the first MATH-500 questions
that render to at most 256 tokens with the member's chat template), the same SamplingParams (temperature 1,
ignore nothing: every response runs to an end token or --max-new-tokens) for each engine. Rounds alternate
between the engines so machine noise hits both; a round's time covers one `generate` call (the engine is built
and warmed up once, outside the timing).
Prints one JSON object: per engine the median seconds per call and generated tokens per second, and
`vllm_over_hf` (tokens/s ratio) when both ran. vLLM needs its own environment on a CPU (`make test-vllm`
builds `.venv-vllm`; vLLM's CPU attention needs the zoo's `small` size). --engines hf runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: no thread pinning

import torch  # noqa: E402

from vlm_corl.config import MemberConfig  # noqa: E402
from vlm_corl.config.schema import RolloutConfig, VllmConfig  # noqa: E402
from vlm_corl.data.loaders import load_examples  # noqa: E402
from vlm_corl.members.engines import make_engine  # noqa: E402
from vlm_corl.members.member import load_member  # noqa: E402
from vlm_corl.members.render import Renderer  # noqa: E402
from vlm_corl.members.rollout import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="member directory (e.g. a zoo member built with --size small)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="hf,vllm")
    parser.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="vLLM KV cache on a CPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    member = load_member(MemberConfig(id="bench", model=args.model, trainable=False))
    rollout = RolloutConfig(
        max_prompt_tokens=256,
        max_new_tokens=args.max_new_tokens,
        vllm=VllmConfig(kv_cache_memory_bytes=None if torch.cuda.is_available() else args.kv_cache_bytes),
    )
    render = Renderer(member, "original", 10**6, 1 << 30)
    # The first --prompts questions that render to at most 256 tokens (tiny models have short position tables).
    rendered = (render(ex) for ex in load_examples("math500", split="test").examples)
    prompts = [p for p in rendered if p.inputs["input_ids"].shape[1] <= rollout.max_prompt_tokens][: args.prompts]
    engines = {name: make_engine(name, member, rollout) for name in args.engines.split(",")}
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    for engine in engines.values():  # warm-up (kernels, caches; the HF engine's static cache bucket), untimed
        engine.generate(prompts, params)
    times = {name: [] for name in engines}
    tokens = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            groups = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": r + 1}))
            times[name].append(time.perf_counter() - start)
            tokens[name].append(sum(len(resp.token_ids) for g in groups for resp in g.responses))
    result = {
        "model": args.model,
        "prompts": len(prompts),
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    for name in engines:
        seconds = statistics.median(times[name])
        result[name] = {
            "seconds_per_call": seconds,
            "tokens": statistics.median(tokens[name]),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens[name], times[name])),
        }
    if "hf" in engines and "vllm" in engines:
        result["vllm_over_hf"] = result["vllm"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

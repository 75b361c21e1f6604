#!/usr/bin/env python3
"""Peak memory of the policy's log-prob pass (one update's forward + backward) and of the no-grad scoring pass
(entropy and self-certainty), before and after the chunked implementation, on a large-vocabulary model.

Prints ONE JSON object. The model is a random Qwen2-style causal LM built from its config: a 151,936-token
vocabulary (Qwen's) with a tiny body (hidden 64, 2 layers), so the logits dominate memory. Each micro-batch
holds --batch responses of --tokens tokens after a short prompt, under bf16 autocast (the update's mixed
precision): the model's logits are one bf16 copy, B*T*V*2 bytes (1.24 GB at full size). "old" is the code
before this change (kept here only: whole-batch fp32 policy logits, log_softmax, gather; stats on all
responses at once); "new" is `vlm_corl.members.update` (`response_logprobs`, `response_token_stats`).

    python bench/memory.py                  # full size: V=151936, T=1024, B=4 (~10 GB peak for "old")
    python bench/memory.py --size tiny      # seconds

Peak: on CUDA, max_memory_allocated above the memory allocated before the pass. On CPU, the peak resident set
(VmHWM, reset through /proc/self/clear_refs) above the resident set before it, with glibc's mmap threshold
fixed so that freed tensors leave the resident set. `peak_x_bf16_logits` divides by one bf16 copy of a
micro-batch's logits; the target is <= 1.5 (the peak includes everything the pass allocates, not only logits).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

SIZES = {  # vocab, response tokens, micro-batch, hidden, layers, fp32 elements per chunk (None: the product's)
    "full": dict(vocab=151936, tokens=1024, batch=4, hidden=64, layers=2, chunk_elements=None),
    # smaller chunks too, else the tiny batch would fit in one chunk
    "tiny": dict(vocab=32000, tokens=128, batch=2, hidden=16, layers=1, chunk_elements=1 << 18),
}
TARGET = 1.5  # peak <= 1.5 x one bf16 copy of a micro-batch's logits
PASSES = ("old_update", "new_update", "old_scoring", "new_scoring")


# --- the code before this change (reference only) -------------------------------------------------------------
def old_policy_logits(logits, temperature, suppressed):
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if suppressed:
        removed = torch.zeros(logits.shape[-1], device=logits.device)
        removed[list(suppressed)] = float("-inf")
        logits = logits + removed
    return logits


def old_forward(model, prompts, responses, pad_id, fn):
    from vlm_corl.members.batching import collate, model_positions

    inputs, mask = collate(prompts, pad_id, responses)
    t = mask.shape[1]
    inputs["position_ids"], _ = model_positions(model, inputs, False)
    logits = model(**inputs, logits_to_keep=t + 1, use_cache=False).logits[:, :-1]
    return fn(logits, inputs["input_ids"][:, -t:]), mask


def old_logprobs(model, prompts, responses, pad_id, temperature, suppressed):
    def policy_logp(logits, targets):
        return (
            torch.log_softmax(old_policy_logits(logits, temperature, suppressed), dim=-1)
            .gather(-1, targets.unsqueeze(-1))
            .squeeze(-1)
        )

    logp, mask = old_forward(model, prompts, responses, pad_id, policy_logp)
    return torch.where(mask.bool(), logp, 0.0), mask


@torch.no_grad()
def old_token_stats(model, prompts, responses, pad_id, temperature, suppressed):
    from vlm_corl.training.rewards.grpo import token_entropy, token_self_certainty

    def stats(logits, targets):
        logits = old_policy_logits(logits, temperature, suppressed)
        return torch.stack([token_entropy(logits), token_self_certainty(logits)], dim=-1)

    values, mask = old_forward(model, prompts, responses, pad_id, stats)
    means = torch.where(mask.bool()[..., None], values, 0.0).sum(dim=1) / mask.sum(dim=1).clamp(min=1)[:, None]
    return {"entropy": means[:, 0], "self_certainty": means[:, 1]}


# ------------------------------------------------------------------------------------------------------------------


class PeakMeter:
    """Peak memory a callable adds above what was allocated before it (bytes)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if not self.cuda:
            self.libc = ctypes.CDLL("libc.so.6")
            # A fixed mmap threshold (it otherwise grows up to 32 MiB) sends every large tensor to mmap, so
            # freeing it returns it to the OS and the resident set follows the live tensors.
            self.libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD

    def __call__(self, fn) -> int:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base
        self.libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        base = self._status("VmRSS")
        fn()
        return self._status("VmHWM") - base

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def build_model(args, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.prompt_tokens + args.tokens + 8,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg).to(device).train()


def batch(args, n: int, tokens: int, device, seed: int):
    """n distinct prompts (no shared-prompt path) and full-length responses of samplable tokens."""
    gen = torch.Generator().manual_seed(seed)
    samplable = args.vocab - len(args.suppressed)  # the suppressed ids are the last ones, as control tokens are
    prompts = [
        {
            "input_ids": torch.randint(samplable, (1, args.prompt_tokens), generator=gen).to(device),
            "attention_mask": torch.ones(1, args.prompt_tokens, dtype=torch.long, device=device),
        }
        for _ in range(n)
    ]
    responses = torch.randint(samplable, (n, tokens), generator=gen).tolist()
    return prompts, responses


def run(args) -> dict:
    from vlm_corl.members.rollout import Policy
    from vlm_corl.members.update import response_logprobs, response_token_stats

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    model = build_model(args, device)
    meter = PeakMeter(device)
    pad = args.suppressed[-1]
    policy = Policy(pad, args.temperature, tuple(args.suppressed))
    update_fn = {
        "old": lambda *a: old_logprobs(*a, args.suppressed),
        "new": lambda *a: response_logprobs(*a[:3], policy),
    }
    scoring_fn = {
        "old": lambda *a: old_token_stats(*a, args.suppressed),
        "new": lambda *a: response_token_stats(*a[:3], policy, micro_batch_size=args.batch),
    }
    results: dict = {}

    def update(impl, prompts, responses):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logp, mask = update_fn[impl](model, prompts, responses, pad, args.temperature)
            loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        results[impl + "_update"] = (logp.detach().float(), torch.cat([p.grad.flatten() for p in model.parameters()]))

    def scoring(impl, prompts, responses):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            stats = scoring_fn[impl](model, prompts, responses, pad, args.temperature)
        results[impl + "_scoring"] = torch.stack([stats["entropy"], stats["self_certainty"]]).float()

    # Warm-up on a small batch: lazily loaded kernels and libraries are not charged to the first measurement.
    small = batch(args, 2, 8, device, seed=1)
    for name in PASSES:
        impl, kind = name.split("_")
        (update if kind == "update" else scoring)(impl, *small)
    results.clear()
    model.zero_grad(set_to_none=True)

    main_batch = batch(args, args.batch, args.tokens, device, seed=0)
    score_batch = batch(args, args.score_responses, args.tokens, device, seed=0)
    peaks = {}
    for name in args.only:
        impl, kind = name.split("_")
        fn = update if kind == "update" else scoring
        peaks[name] = meter(functools.partial(fn, impl, *(main_batch if kind == "update" else score_batch)))
        model.zero_grad(set_to_none=True)
    return report(args, device, peaks, results)


def report(args, device: torch.device, peaks: dict, results: dict) -> dict:
    """The JSON: settings, each pass's peak (bytes, and in units of one bf16 copy of a micro-batch's logits),
    the new/old ratio and the target, and how closely the two implementations agree."""
    from vlm_corl.training.rewards import grpo

    bf16_logits = args.batch * args.tokens * args.vocab * 2
    out = {
        "device": device.type,
        "method": "cuda max_memory_allocated" if device.type == "cuda" else "VmHWM - VmRSS (resident set)",
        "vocab": args.vocab,
        "tokens": args.tokens,
        "batch": args.batch,
        "score_responses": args.score_responses,
        "hidden": args.hidden,
        "layers": args.layers,
        "prompt_tokens": args.prompt_tokens,
        "temperature": args.temperature,
        "suppressed": len(args.suppressed),
        "autocast": "bf16",
        "chunk_rows": max(1, grpo.CHUNK_ELEMENTS // args.vocab),
        "bf16_logits_bytes": bf16_logits,
        "target_x_bf16_logits": TARGET,
    }
    for kind in ("update", "scoring"):
        row = {}
        for impl in ("old", "new"):
            if f"{impl}_{kind}" in peaks:
                peak = peaks[f"{impl}_{kind}"]
                row[impl] = {
                    "peak_bytes": peak,
                    "peak_gb": round(peak / 1e9, 3),
                    "peak_x_bf16_logits": round(peak / bf16_logits, 3),
                }
        if "new" in row:
            row["meets_target"] = row["new"]["peak_x_bf16_logits"] <= TARGET
        if "old" in row and "new" in row:
            row["new_over_old"] = round(row["new"]["peak_bytes"] / row["old"]["peak_bytes"], 3)
        out[kind] = row
    if {"old_update", "new_update"} <= results.keys():  # the two implementations agree
        (lo, go), (ln, gn) = results["old_update"], results["new_update"]
        out["update"]["logp_max_abs_diff"] = float((lo - ln).abs().max())
        out["update"]["grad_max_rel_diff"] = float((go - gn).abs().max() / go.abs().max())
    if {"old_scoring", "new_scoring"} <= results.keys():
        out["scoring"]["stats_max_abs_diff"] = float((results["old_scoring"] - results["new_scoring"]).abs().max())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full", help="defaults of the options below")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--tokens", type=int, help="response tokens (every response has this length)")
    ap.add_argument("--batch", type=int, help="micro-batch: responses per forward (update and new scoring)")
    ap.add_argument(
        "--score-responses",
        type=int,
        help="responses scored (old: in one pass; new: in micro-batches); default --batch",
    )
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument(
        "--chunk-elements", type=int, help="sets vlm_corl.training.rewards.grpo.CHUNK_ELEMENTS (fp32 elements a chunk)"
    )
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--only", nargs="+", choices=PASSES, default=list(PASSES), help="measure only these passes")
    ap.add_argument("--cpu", action="store_true", help="measure on CPU even when CUDA is available")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    for key, value in SIZES[args.size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.score_responses = args.score_responses or args.batch
    args.suppressed = [args.vocab - 3, args.vocab - 2, args.vocab - 1]  # control tokens; the last one pads
    if args.chunk_elements:
        from vlm_corl.training.rewards import grpo

        grpo.CHUNK_ELEMENTS = args.chunk_elements
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = run(args)
    result["size"] = args.size
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

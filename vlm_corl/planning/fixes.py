"""Concrete changes that make a cohort's plan fit, each with the memory it saves on the tightest rank: gradient
checkpointing, a smaller micro-batch, vLLM sleep mode, ZeRO-2 / ZeRO-3 / ZeRO-3 with CPU offload, and more
ranks (the same layout launched on more GPUs). Every change is planned again, not guessed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.schema import CohortConfig
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import CohortPlan, Hardware, fits_after, with_changes, zero_settings

DEEPSPEED_DIR = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"
# (name, stage, offload): the ZeRO presets under configs/deepspeed/, cheapest first
ZERO_PRESETS = (("zero2.json", 2, False), ("zero3.json", 3, False), ("zero3_offload.json", 3, True))
SCALE_FACTORS = (2, 4, 8, 16)


def preset_path(name: str) -> str:
    """A ZeRO preset's path as a user would write it: relative to the working directory when it is below it."""
    path = DEEPSPEED_DIR / name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def zero_rank(cfg: CohortConfig) -> tuple[int, bool]:
    """(ZeRO stage or 0, offload) of `cfg`."""
    zero = zero_settings(cfg)
    return (zero.get("stage", 2) if zero else 0), "offload_optimizer" in zero or "offload_param" in zero


def scaled_ranks(cfg: CohortConfig, factor: int) -> dict[str, Any]:
    """members[i].ranks for a launch `factor` times as wide (each rank becomes `factor` consecutive ones); {}
    when the placement is automatic (it widens by itself)."""
    if not all(m.ranks for m in cfg.members):
        return {}
    return {
        f"members.{i}.ranks": [r * factor + k for r in m.ranks for k in range(factor)]
        for i, m in enumerate(cfg.members)
    }


def fixes(cfg: CohortConfig, plan: CohortPlan) -> list[dict]:
    """The changes that lower the tightest rank's peak, each planned: {change, overrides (dotted), launch (a
    wider launch, when it needs one), saves_gb, peak_gb, fits}. First each change alone (a family of changes,
    such as the micro-batch's halvings, by its mildest that fits, else its strongest); then, when none fits
    alone, the ones that help taken together; then the narrowest wider launch that fits, under ZeRO-3 with
    those changes. Those that fit come first. Every change is planned with `plan.shapes` (its members' models,
    already read)."""
    hw, worst = plan.hardware, plan.worst
    before = worst.peak

    def planned(label: str, changes: dict, target: Hardware) -> dict | None:
        after = fits_after(with_changes(cfg, changes), target, plan.shapes)
        if after is None:
            return None
        peak = after.peak_of(worst.rank) if target is hw else max(r.peak for r in after.ranks)
        fix = {
            "change": label,
            "overrides": [f"{k}={yaml_value(v)}" for k, v in changes.items()],
            "saves_gb": round((before - peak) / GB, 2),
            "peak_gb": round(peak / GB, 2),
            "fits": after.fits,
        }
        if target is not hw:
            fix["launch"] = f"{target.processes} processes"
        return fix if fix["saves_gb"] > 0 else None

    families = _families(cfg, hw)
    out = []
    for family in families:
        tried = [f for label, changes in family if (f := planned(label, changes, hw)) is not None]
        if tried:
            out.append(next((f for f in tried if f["fits"]), tried[-1]))
    # Together: each family's strongest change short of CPU offload (the last resort, never implied).
    strongest = [next((c for c in reversed(family) if "offload" not in str(c[1])), None) for family in families]
    strongest = [c for c in strongest if c is not None]
    together = {k: v for _, changes in strongest for k, v in changes.items()}
    names = ", ".join(label for label, _ in strongest)
    if not any(f["fits"] for f in out) and len(strongest) > 1:
        combined = planned(f"together: {names}", together, hw)
        out += [combined] if combined else []
    stage, offload = zero_rank(cfg)
    wider = {**together, **({"train.deepspeed": preset_path("zero3.json")} if (stage, offload) < (3, False) else {})}
    if not any(f["fits"] for f in out) and wider:
        others = ", ".join(label for label, changes in strongest if "train.deepspeed" not in changes)
        for factor in SCALE_FACTORS:
            label = f"{hw.processes * factor} ranks"
            target = Hardware(hw.processes * factor, hw.device_bytes, hw.cuda, label, hw.ranks_per_node)
            label = f"ZeRO-3 over {factor}x the ranks" + (f", with {others}" if others else "")
            fix = planned(label, {**wider, **scaled_ranks(cfg, factor)}, target)
            if fix is not None and fix["fits"]:
                out.append(fix)
                break
    return sorted(out, key=lambda f: (not f["fits"], "launch" in f, -f["saves_gb"]))


def _families(cfg: CohortConfig, hw: Hardware) -> list[list[tuple[str, dict]]]:
    """The single changes to try, by family, mildest first: [(label, dotted changes), ...]."""
    families = []
    if not cfg.train.gradient_checkpointing and any(m.trainable for m in cfg.members):
        families.append([("gradient checkpointing", {"train.gradient_checkpointing": True})])
    halvings, mb = [], cfg.train.micro_batch_size
    while mb != "auto" and mb > 1:  # auto is already the largest that fits (1 when none does)
        mb //= 2
        halvings.append((f"micro-batch {mb}", {"train.micro_batch_size": mb}))
    families.append(halvings)
    if hw.cuda and not cfg.rollout.vllm.enable_sleep_mode and any(member_engine(cfg, m) == "vllm" for m in cfg.members):
        families.append([("vLLM sleep mode during updates", {"rollout.vllm.enable_sleep_mode": True})])
    stage, offload = zero_rank(cfg)
    zero = [
        (f"ZeRO-{st}" + (" with CPU offload" if off else ""), {"train.deepspeed": preset_path(name)})
        for name, st, off in ZERO_PRESETS
        if (st, off) > (stage, offload)
    ]
    families.append(zero)
    return [f for f in families if f]


def yaml_value(value: Any) -> str:
    """A value as a dotted override writes it: true/false, null, [0,1,2], scalars as they are."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)

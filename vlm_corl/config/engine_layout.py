"""Which rollout engine every member runs, and which engines every rank builds: the layouts vLLM cannot run.

vLLM's torchrun launcher (`external_launcher`, what an in-process engine uses under torchrun/accelerate) meets
every rank of the job each time an engine is built: creating its process groups, then taking the minimum of
every rank's free KV-cache memory (vLLM 0.11-0.33, `ExecutorWithExternalLauncher.determine_available_memory`).
Ranks that build different numbers of engines therefore hang at start-up until the collective timeout. Its
sleep mode allows one sleeping engine per process. Both are checked here from the config and the placement,
before any model is loaded: by `python -m vlm_corl.config` when the ranks are known, and by `train` at start.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlm_corl.config.schema import CohortConfig, MemberConfig

# config.json model types vLLM cannot serve (encoder-decoder models other than Whisper went in vLLM 0.10.2)
VLLM_UNSUPPORTED = {"mllama": "Llama-3.2-Vision (mllama)"}


def member_engine(cfg: CohortConfig, member: MemberConfig) -> str:
    """The rollout engine of `member`: members[i].engine, else rollout.engine."""
    return member.engine or cfg.rollout.engine


def model_type(model_dir: str | Path) -> str | None:
    """config.json's model_type of a model directory (None when it cannot be read)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def vllm_engines_by_rank(
    cfg: CohortConfig, placement: dict[str, tuple[int, ...]], teachers: bool
) -> dict[int, list[str]]:
    """{rank: the vLLM engines it builds, in build order}: one per hosted member on vLLM, then one per EMA
    teacher (`teachers`: the reward keeps one per member, co_rewarding_2 and peers_ema), as
    `training.slots.build_slots` does."""
    ranks = sorted({r for rs in placement.values() for r in rs})
    built: dict[int, list[str]] = {r: [] for r in ranks}
    on_vllm = [m for m in cfg.members if member_engine(cfg, m) == "vllm"]
    for suffix in ("", ".teacher") if teachers else ("",):
        for m in on_vllm:
            for r in placement[m.id]:
                built[r].append(m.id + suffix)
    return built


def engine_layout_problems(
    cfg: CohortConfig, placement: dict[str, tuple[int, ...]], teachers: bool
) -> list[tuple[str, str]]:
    """(field, message) for every layout vLLM cannot run: ranks of a multi-process job that would build
    different numbers of vLLM engines (a hang at start-up), and sleep mode where a process hosts several."""
    built = vllm_engines_by_rank(cfg, placement, teachers)
    problems = []
    counts = {r: len(engines) for r, engines in built.items()}
    if len(counts) > 1 and len(set(counts.values())) > 1:
        detail = "; ".join(f"rank {r}: {', '.join(e) or 'none'}" for r, e in built.items())
        problems.append(
            (
                "members",
                "every process of a multi-process job must build the same number of vLLM engines (vLLM's launcher "
                f"meets all ranks for each engine built; unequal counts hang at start-up), but {detail}. Put "
                "members on the HF engine beside a vLLM member on the same ranks (members[i].ranks), give every "
                "member the same engine (members[i].engine / rollout.engine), or place the members so every rank "
                "hosts as many vLLM members",
            )
        )
    crowded = {r: e for r, e in built.items() if len(e) > 1}
    if cfg.rollout.vllm.enable_sleep_mode and crowded:
        r, engines = next(iter(crowded.items()))
        problems.append(
            (
                "rollout.vllm.enable_sleep_mode",
                f"vLLM's sleep mode allows one engine per process, but rank {r} builds {len(engines)} "
                f"({', '.join(engines)}): give each vLLM member its own ranks (members[i].ranks), move the others "
                "to the HF engine (members[i].engine: hf), or turn sleep mode off",
            )
        )
    return problems

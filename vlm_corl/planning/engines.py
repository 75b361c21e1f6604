"""The vLLM engines of a launch, as vLLM divides their memory: each engine's share of gpu_memory_utilization holds
its weights, its profiled activation peak, what sleep mode cannot free (the CUDA-graph pool and its buffers), and
the KV cache in what is left. Under torchrun vLLM's external launcher then gives every rank's n-th engine the
smallest KV cache of all ranks' n-th engines (`uniproc_executor.determine_available_memory` all-reduces the
available memory with MIN): `slot_minimum` is what every engine of slot n really gets. Both sleep levels free the
same device memory (the weights and the KV cache); level 1 keeps a copy of the weights on the host (planning/host.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vlm_corl.config.engine_layout import vllm_engines_by_rank
from vlm_corl.config.schema import CohortConfig, MemberConfig, has_teachers
from vlm_corl.distributed.world import shard
from vlm_corl.members.memory import GB
from vlm_corl.planning import estimates as est
from vlm_corl.planning.shapes import Shapes

TEACHER = ".teacher"  # an EMA teacher's engine name: its student's id and this suffix


@dataclass(frozen=True)
class EngineShare:
    """One vLLM engine on one rank: the bytes of its share by part and the KV cache it would get alone."""

    engine: str  # member id, or member id + TEACHER
    rank: int
    slot: int  # its place in the rank's build order (vLLM's launcher matches engines by it)
    share: float
    weights: float
    activations: float
    sleep_keeps: float  # what sleep mode leaves on the GPU at either level (part of the share while awake)
    own_kv: float  # share - weights - activations - sleep_keeps (or kv_cache_memory_bytes / engines)
    one_sequence: float  # KV cache one sequence of max_model_len needs
    all_sequences: float  # KV cache for every sequence of a step at once


@dataclass(frozen=True)
class SlotKV:
    """Engine slot n over the launch: the KV cache every rank's n-th engine gets (the smallest), and where."""

    slot: int
    kv: float
    rank: int  # the rank whose engine sets the minimum
    engine: str
    by_rank: dict[int, float]  # the KV cache each rank's engine would get alone

    def to_dict(self, shares: dict[tuple[int, int], EngineShare]) -> dict:
        short = [r for r in self.by_rank if self.kv < shares[(r, self.slot)].one_sequence]
        return {
            "slot": self.slot,
            "kv_cache_gb": round(self.kv / GB, 3),
            "set_by": {"rank": self.rank, "engine": self.engine},
            "by_rank_gb": {str(r): round(v / GB, 3) for r, v in self.by_rank.items()},
            "holds_one_sequence": not short,
        }


def engine_shares(
    cfg: CohortConfig,
    shapes: Shapes,
    placement: dict,
    device_bytes: float,
    cuda: bool,
    dtype_of: Callable[[MemberConfig], int],
) -> dict:
    """{(rank, slot): EngineShare} of every vLLM engine the launch builds (`vllm_engines_by_rank`) on cards of
    `device_bytes`; `shapes`: the plan's; `dtype_of(member)`: bytes per parameter of its engine's weights (the
    rollout dtype)."""
    v, r = cfg.rollout.vllm, cfg.rollout
    built = vllm_engines_by_rank(cfg, placement, has_teachers(cfg))
    members = {m.id: m for m in cfg.members}
    max_model_len = r.max_prompt_tokens + r.max_new_tokens
    out = {}
    for rank, engines in built.items():
        for slot, name in enumerate(engines):
            m = members[name.removesuffix(TEACHER)]
            shape = shapes[m.id]
            dtype = dtype_of(m)
            share = v.gpu_memory_utilization * device_bytes / len(engines)
            weights = dtype * shape.params
            patches = shape.patches_per_image(cfg.data.max_image_pixels)
            acts = est.vllm_activation_bytes(shape, device_bytes, dtype, patches)
            keeps = est.vllm_sleep_keeps(v.enforce_eager) if cuda else 0.0
            own = v.kv_cache_memory_bytes / len(engines) if v.kv_cache_memory_bytes else share - weights - acts - keeps
            rows = len(shard(cfg.data.batch_size, placement[m.id], rank)) * r.n
            one, every = est.vllm_kv_need(shape, rows, max_model_len, dtype)
            out[(rank, slot)] = EngineShare(name, rank, slot, share, weights, acts, keeps, own, one, every)
    return out


def slot_minimum(shares: dict) -> dict[int, SlotKV]:
    """{slot: SlotKV}: the smallest KV cache over the ranks' engines of each slot (what vLLM's launcher gives
    every one of them)."""
    out: dict[int, SlotKV] = {}
    for (rank, slot), s in sorted(shares.items()):
        seen = out.get(slot)
        by_rank = {**(seen.by_rank if seen else {}), rank: s.own_kv}
        if seen is None or s.own_kv < seen.kv:
            out[slot] = SlotKV(slot, s.own_kv, rank, s.engine, by_rank)
        else:
            out[slot] = SlotKV(slot, seen.kv, seen.rank, seen.engine, by_rank)
    return out

"""The host-memory plan of two layouts only a GPU node runs (issue 45, item 7), through the planner's public call
on real architectures' configs (read on the meta device), each number worked by hand:

- a LoRA member whose vLLM engine serves its adapter (rollout.vllm.lora_sync: adapter) keeps its base in vLLM
  and sleeps at level 1 for the update: vLLM backs the engine's weights up in pinned host memory at every sleep;
- ZeRO-3 with CPU offload (configs/deepspeed/zero3_offload.json) over several ranks: the fp32 masters, Adam's
  moments and the fp32 gradients (and the offloaded weights) live in host RAM partitioned over the member's
  ranks, so the ranks of one node hold the member's state once between them, not once each, and each node of a
  member spread over several holds its own ranks' partitions."""

from __future__ import annotations

import pytest
from cohort_helpers import ROOT

from vlm_corl.config import config_from_dict
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import Hardware, plan_cohort
from vlm_corl.planning.shapes import model_shape

MODELS = ROOT / "configs" / "models"
QWEN3B, INTERN, QWEN7B = (
    str(MODELS / n) for n in ("qwen2.5-vl-3b-instruct", "internvl3-2b-hf", "qwen2.5-vl-7b-instruct")
)
P_QWEN3B, P_INTERN, P_QWEN7B = 3_754_622_976, 2_088_957_440, 8_292_166_656  # parameters, from their config.json
ZERO3_OFFLOAD = str(ROOT / "configs" / "deepspeed" / "zero3_offload.json")
PROCESS = 3e9  # every rank's own process (planning/host.py HOST_PROCESS_BYTES)
MIB = 2**20


def test_the_parameter_counts_the_hand_numbers_use():
    assert [model_shape(m).params for m in (QWEN3B, INTERN, QWEN7B)] == [P_QWEN3B, P_INTERN, P_QWEN7B]


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_a_lora_engine_serving_its_adapter_backs_its_base_up_on_the_host_while_it_sleeps(lora_sync):
    """Two LoRA members on vLLM, one rank each (sleep mode: one engine per process), a node of two ranks. With
    lora_sync adapter vLLM holds each base in the rollout dtype (bf16 on CUDA: 2 bytes a parameter) and sleeps at
    level 1, which copies those weights to pinned host memory; with merged it sleeps at level 2 and discards
    them (the sync pushes the merged weights): nothing on the host."""
    cfg = config_from_dict(
        {
            "members": [
                {"id": "qwen", "model": QWEN3B, "lora": {"r": 16}},
                {"id": "intern", "model": INTERN, "lora": {"r": 16}},
            ],
            "rollout": {"engine": "vllm", "vllm": {"enable_sleep_mode": True, "lora_sync": lora_sync}},
            "data": {"prompt_cache_mb": 100},
            "train": {"async_checkpoint": False},  # its host copies: tests/test_planner_counts.py
        }
    )
    plan = plan_cohort(cfg, Hardware(2, 80 * GB))
    assert plan.placement == {"qwen": (0,), "intern": (1,)}
    backups = [2 * P_QWEN3B, 2 * P_INTERN] if lora_sync == "adapter" else [0, 0]  # 7.51 GB, 4.18 GB
    for rank, backup in enumerate(backups):
        host = plan.host.ranks[rank]
        assert host.init == {"process": PROCESS}  # no DeepSpeed: nothing staged
        # the process, one renderer's prompt cache (one slot per member under ring), the engine's backup
        training = dict(host.training)
        assert training.pop("vllm_sleep_backups", 0) == backup
        assert training == {"process": PROCESS, "prompt_caches": 100 * MIB}
    node = 2 * (PROCESS + 100 * MIB) + sum(backups)  # one node: both ranks' peaks (training) summed
    assert plan.host.nodes() == [pytest.approx(node)]


def test_zero3_offload_over_the_ranks_of_one_node_holds_the_members_state_once():
    """Qwen2.5-VL-7B (P parameters) on both ranks of one node under zero3_offload.json (offload_optimizer and
    offload_param): each rank's host holds its half of the fp32 master (4P), Adam's moments (8P) and the fp32
    gradients (4P), and of the fp32 weight partitions (4P): 20P / 2 = 10P; the node, 20P: the whole member once.
    At start-up each rank stages the whole model on the host (8P: the fp32 model and the casts), less than 10P."""
    cfg = config_from_dict(
        {
            "members": [{"id": "m", "model": QWEN7B}],
            "reward": {"mode": "self_vote"},
            "train": {"deepspeed": ZERO3_OFFLOAD},
            "data": {"batch_size": 8, "prompt_cache_mb": 100},
        }
    )
    plan = plan_cohort(cfg, Hardware(2, 80 * GB))
    assert plan.placement == {"m": (0, 1)}
    for host in plan.host.ranks:
        assert host.init == {"process": PROCESS, "staging": 8 * P_QWEN7B}  # 66.3 GB
        assert host.training == {"process": PROCESS, "offload m": (16 + 4) * P_QWEN7B / 2, "prompt_caches": 100 * MIB}
        assert host.peak == PROCESS + 10 * P_QWEN7B + 100 * MIB  # 85.9 GB: training above start-up
    node = 2 * (PROCESS + 100 * MIB) + 20 * P_QWEN7B  # 171.9 GB
    assert plan.host.nodes() == [pytest.approx(node)]
    assert plan.to_dict()["host_memory_gb"] == [round(node / GB, 3)]


def test_zero3_offload_over_two_nodes_holds_each_nodes_own_partitions():
    """The same member on 4 ranks, 2 a node: each rank holds 20P / 4 = 5P, each node 10P, half the member's
    state (its two ranks' partitions). Start-up then peaks: every rank stages the whole model (8P), so a node
    needs 2 x (3 GB + 8P) = 138.7 GB, what the plan reports."""
    cfg = config_from_dict(
        {
            "members": [{"id": "m", "model": QWEN7B}],
            "reward": {"mode": "self_vote"},
            "train": {"deepspeed": ZERO3_OFFLOAD},
            "data": {"batch_size": 8, "prompt_cache_mb": 100},
        }
    )
    plan = plan_cohort(cfg, Hardware(4, 80 * GB, ranks_per_node=2))
    assert plan.placement == {"m": (0, 1, 2, 3)}
    offload = [host.training["offload m"] for host in plan.host.ranks]
    assert offload == [20 * P_QWEN7B / 4] * 4
    assert [offload[0] + offload[1], offload[2] + offload[3]] == [10 * P_QWEN7B] * 2  # per node: half the state
    assert plan.host.nodes() == [pytest.approx(2 * (PROCESS + 8 * P_QWEN7B))] * 2

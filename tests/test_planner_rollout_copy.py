"""Issue 55: the memory plan of a trained member's bf16 rollout copy, of the static decoder's bucket and CUDA-graph
pool, and of the pinned host copies of background checkpoints (R4-1, R4-2, R4-12), worked by hand on a tiny
Qwen2 whose config.json is written here (the planner reads nothing else)."""

from __future__ import annotations

import json

import pytest
from cohort_helpers import ROOT

from vlm_corl.config import config_from_dict
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import Hardware, plan_cohort
from vlm_corl.planning.shapes import model_shape

GEMMA = str(ROOT / "configs" / "models" / "gemma-3-4b-it")
ZERO2 = str(ROOT / "configs" / "deepspeed" / "zero2.json")
ZERO3 = str(ROOT / "configs" / "deepspeed" / "zero3.json")
# hidden 64, 2 layers, 4 query heads and 2 KV heads of head_dim 16, MLP 128, vocabulary 1000, untied lm_head
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": False}  # fmt: skip
# its tensors' elements by hand: embeddings and lm_head 1000 x 64; per layer q and o 64 x 64, q's bias 64, k and v
# 32 x 64 with 32-element biases, gate, up and down 64 x 128, two norms of 64; the final norm
TENSORS = [64_000, 64_000, 64] + 2 * [4096, 64, 2048, 32, 2048, 32, 4096, 8192, 8192, 8192, 64, 64]
P = sum(TENSORS)
# the same, each rounded up to a power of two (64 000 -> 65 536; the rest are powers of two already)
P_POW2 = 2 * 65_536 + 64 + 2 * (4096 + 64 + 2048 + 32 + 2048 + 32 + 4096 + 8192 + 8192 + 8192 + 64 + 64)
KV_PAIR = 2 * 2 * 16  # layers x KV heads x head_dim: elements of one token's keys (and as many values)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """{dtype: the directory of the tiny Qwen2's config.json saved in that dtype}."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        path = tmp_path_factory.mktemp(f"tiny-{dtype}")
        (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                       "dtype": dtype, **TINY}))  # fmt: skip
        out[dtype] = str(path)
    return out


def plan(model: str, cuda: bool = True, member: dict | None = None, **sections) -> dict[str, tuple[float, str]]:
    """{part: (bytes, phase)} of one trained member of `model` (self_vote), 3 prompts x K 16, 300 + 100 tokens."""
    rollout = {"n": 16, "max_prompt_tokens": 300, "max_new_tokens": 100, **sections.pop("rollout", {})}
    cfg = config_from_dict({"members": [{"id": "m", "model": model, **(member or {})}], "reward": {"mode": "self_vote"},
                            "data": {"batch_size": 3}, "rollout": rollout, **sections})  # fmt: skip
    return {it.part: (it.bytes, it.phase) for it in plan_cohort(cfg, Hardware(1, 80 * GB, cuda=cuda)).ranks[0].items}


def test_the_tiny_shape_by_hand(tiny):
    shape = model_shape(tiny["float32"])
    assert (shape.params, shape.pow2_params, shape.heads, shape.head_dim) == (P, P_POW2, 4, 16)
    assert shape.static_decode and not model_shape(GEMMA).static_decode  # Gemma-3: sliding-window layers


def test_a_trained_member_on_cuda_samples_from_its_copy_and_decodes_over_a_bucket(tiny):
    """Plain data parallel on CUDA (bf16 rollouts of fp32 masters): the copy is resident, 2 bytes a parameter, and
    replaces the rollout's autocast casts; the decode's KV is one bucket of bf16 keys and values: 48 rows -> 64,
    400 positions -> 512; the graph pool holds the bucket's fp32 logits and one layer's K/V replicated to the 4
    query heads; the prefix's KV (48 x 300 positions) exceeds the prefill's transient by what is counted beside."""
    got = plan(tiny["float32"])
    assert got["rollout_copy"] == (2 * P, "resident")
    assert ("autocast_weights", "rollout") not in {(part, phase) for part, (_, phase) in got.items()}
    assert got["rollout_static_kv_cache"] == (64 * 512 * KV_PAIR * (2 + 2), "rollout")
    assert got["rollout_static_graph_pool"] == (64 * 1000 * 4 + 64 * 512 * 4 * 16 * (2 + 2), "rollout")
    prefill = 3 * 300 * 2 * (4 * 64 + 2 * 128) + 48 * 1000 * 4 * 4  # one layer over the prompts, the last logits
    assert got["rollout_prefill"] == (prefill, "rollout")
    assert got["rollout_static_prefix_kv"] == (48 * 300 * KV_PAIR * 4 - prefill, "rollout")
    assert "rollout_kv_cache" not in got
    assert plan(tiny["float32"], train={"deepspeed": ZERO2})["rollout_copy"] == (2 * P, "resident")  # ZeRO-2 too


def test_no_copy_or_bucket_where_they_do_not_apply(tiny):
    eager_kv = 48 * 400 * KV_PAIR
    cpu = plan(tiny["float32"], cuda=False)  # fp32 rollouts of an fp32 checkpoint, the eager loop
    assert "rollout_copy" not in cpu and "rollout_static_kv_cache" not in cpu
    assert cpu["rollout_kv_cache"] == (eager_kv * (4 + 4), "rollout")
    off = plan(tiny["float32"], rollout={"hf_static_cache": "off"})  # the copy, the eager loop's cache
    assert off["rollout_copy"] == (2 * P, "resident") and off["rollout_kv_cache"] == (eager_kv * (2 + 2), "rollout")
    assert not [part for part in off if part.startswith("rollout_static")]
    vllm = plan(tiny["float32"], rollout={"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.3}})
    assert "rollout_copy" not in vllm and not [part for part in vllm if part.startswith("rollout_")]
    lora = plan(tiny["bfloat16"], member={"lora": {"r": 4}})  # its bf16 base samples as it is
    assert "rollout_copy" not in lora and "rollout_static_kv_cache" in lora
    zero3 = plan(tiny["float32"], train={"deepspeed": ZERO3})  # its engine's own copy
    assert "rollout_copy" not in zero3 and zero3["full_copy"] == (2 * P, "resident")
    gemma = plan(GEMMA)  # a model the static cache cannot hold keeps the eager loop
    assert "rollout_kv_cache" in gemma and "rollout_static_kv_cache" not in gemma


def test_a_lora_members_fp32_base_under_autocast_counts_fp32_keys_and_values(tiny):
    """The one HF rollout left over fp32 weights under autocast: transformers 5.19 caches values in the keys'
    dtype, so 4 + 4 (an upper bound under 5.25's bf16 values), and the autocast casts stay a rollout item."""
    got = plan(tiny["float32"], member={"lora": {"r": 4}}, rollout={"hf_static_cache": "off"})
    assert got["rollout_kv_cache"] == (48 * 400 * KV_PAIR * (4 + 4), "rollout")
    assert "rollout_copy" not in got


def test_pinned_checkpoint_copies_round_each_tensor_to_a_power_of_two(tiny):
    """R4-12: a background checkpoint of a bf16 member on CUDA: its weights (2P, pageable) and, pinned, Adam's
    moments and the fp32 masters, each tensor's bytes rounded up to a power of two (12 bytes x P_POW2)."""
    cfg = config_from_dict({"members": [{"id": "m", "model": tiny["bfloat16"]}], "reward": {"mode": "self_vote"}})
    host = plan_cohort(cfg, Hardware(1, 80 * GB)).host.ranks[0]
    assert host.training["checkpoint_copies"] == 2 * P + 12 * P_POW2

"""A torchrun worker (2 processes, gloo): one member partitioned by ZeRO-3 with no full copy (what vLLM
rollouts use) beside a twin that keeps the copy (what HF rollouts use), both on ranks {0, 1}, same weights,
same sequences. After one update the partitioned member's streamed weights (`Member.full_weights`, gathered
a bucket at a time), its saved checkpoint, its replica checksum, an EMA teacher fed from the stream and its
lockstep scoring pass (ranks with different numbers of responses) must equal the twin's.

    torchrun --nproc_per_node 2 tests/zero3_stream_worker.py MODEL_DIR OUT_DIR [--vllm]

With --vllm (the vLLM lane) the partitioned member's vLLM engine, synced from the stream, must also decode
greedily exactly what the HF engine decodes with the saved weights. A vision member trains on easy-vqa, a text
one on MATH-500. Rank 0 writes OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from vlm_corl.commands.train import exit_process
from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import AlgoConfig, RolloutConfig, TrainConfig, VllmConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.distributed.world import build_groups, launch_world, weights_checksum
from vlm_corl.members.deepspeed_update import GroupMPU, attach_deepspeed
from vlm_corl.members.engines import make_engine
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.update import Sequence, policy_update, response_token_stats
from vlm_corl.training.run.slots import ema_update

ROOT = Path(__file__).resolve().parents[1]
BUCKET = 64 << 10  # a small bucket so that the stream gathers in several rounds
SEEN = {"initialize": [], "gathers": []}


def record_deepspeed() -> None:
    """What DeepSpeed is handed: the module at initialize (partitioned already? gradients?) and the bytes of
    every GatheredParameters call."""
    import deepspeed

    initialize, gathered = deepspeed.initialize, deepspeed.zero.GatheredParameters

    def init(**kwargs):
        params = list(kwargs["model"].parameters())
        SEEN["initialize"].append(all(hasattr(p, "ds_id") and p.grad is None for p in params))
        return initialize(**kwargs)

    def gather(params, *args, **kwargs):
        SEEN["gathers"].append(sum(p.ds_numel * p.element_size() for p in params))
        return gathered(params, *args, **kwargs)

    deepspeed.initialize, deepspeed.zero.GatheredParameters = init, gather


def member(cfg_id: str, model: str, world, train: TrainConfig, keep_full_copy: bool):
    m = load_member(MemberConfig(id=cfg_id, model=model), device=world.device, stage_on_cpu=True)
    m.group = world.group((0, 1))
    mpu = GroupMPU(m.group, world.singles[world.rank])
    attach_deepspeed(m, train, 4, mpu, keep_full_copy, bucket_bytes=BUCKET)
    return m


def main() -> None:
    model, out, use_vllm = sys.argv[1], Path(sys.argv[2]), "--vllm" in sys.argv
    world = launch_world(600, need_group=True)
    record_deepspeed()
    build_groups(world, {"p": (0, 1), "c": (0, 1)}, every=True)
    train = TrainConfig(
        lr=1e-2, warmup_ratio=0.0, micro_batch_size=2, deepspeed=str(ROOT / "configs" / "deepspeed" / "zero3.json")
    )
    original = {k: v.clone() for k, v in load_member(MemberConfig(id="o", model=model)).model.state_dict().items()}
    part, twin = member("p", model, world, train, False), member("c", model, world, train, True)
    assert part.partitioned and not twin.partitioned
    result = {"initial_equal": all(torch.equal(original[k], t) for k, t in part.full_weights())}
    # ZeRO-3 weights are partitioned before DeepSpeed sees the module, and no gradient is allocated first
    result["partitioned_before_initialize"] = SEEN["initialize"] == [True, True]
    # Adam's moments exist before the first step (before any vLLM engine would be built), over every partition
    zero = part.deepspeed.optimizer
    states = [zero.optimizer.state.get(f, {}) for f in zero.fp32_partitioned_groups_flat]
    result["adam_state_at_build"] = all(
        s and s["step"].item() == 0 and s["exp_avg_sq"].shape == f.shape
        for s, f in zip(states, zero.fp32_partitioned_groups_flat)
    )

    render = Renderer(part, "original", 10**6, 10**6)
    examples = load_examples(
        "easyvqa" if part.is_vision else "math500", split="train" if part.is_vision else "test", limit=6
    ).examples
    prompts = [render(ex) for ex in examples[world.rank * 3 : world.rank * 3 + 3]]
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=7, first_position=world.rank * 3)
    groups = make_engine("hf", twin).generate(prompts, params)
    seqs = [
        Sequence(g.prompt.inputs, r.token_ids, advantage=(-1.0) ** k) for g in groups for k, r in enumerate(g.responses)
    ]
    totals = (2 * sum(len(s.token_ids) for s in seqs), 2 * len(seqs))  # both ranks' shares (same sizes here)
    policy_update(part, seqs, AlgoConfig(), train, RolloutConfig(max_new_tokens=8), totals)
    SEEN["gathers"].clear()
    policy_update(twin, seqs, AlgoConfig(), train, RolloutConfig(max_new_tokens=8), totals)  # refreshes its copy
    largest = max(p.ds_numel * p.element_size() for p in twin.model.parameters())
    result["refresh_in_buckets"] = len(SEEN["gathers"]) > 1 and max(SEEN["gathers"]) <= max(BUCKET, largest)

    streamed = {k: t.clone() for k, t in part.full_weights()}
    copy = dict(twin.deepspeed.full_copy.state_dict())
    result["updated"] = any(not torch.equal(original[k], t) for k, t in streamed.items())
    result["stream_equals_copy"] = all(torch.equal(copy[k], t) for k, t in streamed.items())
    result["stream_names"] = sorted(streamed) == sorted(k for k in copy if k in streamed)
    result["checksum_equal"] = weights_checksum(t for _, t in part.full_weights()) == weights_checksum(
        t for _, t in twin.full_weights()
    )

    teacher_a = load_member(MemberConfig(id="ta", model=model, trainable=False)).model.float()
    teacher_b = load_member(MemberConfig(id="tb", model=model, trainable=False)).model.float()
    ema_update(teacher_a, part.full_weights(), 0.5)
    ema_update(teacher_b, twin.full_weights(), 0.5)
    result["ema_equal"] = all(torch.equal(a, b) for a, b in zip(teacher_a.parameters(), teacher_b.parameters()))

    # Rank 0 scores 3 responses, rank 1 all 6: with micro-batches of 2 that is 2 passes vs 3, so rank 0 runs
    # a filler; without it the ZeRO-3 gathers of the two ranks would not pair up and the job would hang.
    mine = [(g.prompt.inputs, r.token_ids) for g in groups for r in g.responses][: 3 if world.rank == 0 else 6]
    stats = []
    for m in (part, twin):
        count = -(-len(mine) // 2)
        with m.updating():
            stats.append(
                response_token_stats(
                    m.scoring_module,
                    [p for p, _ in mine],
                    [t for _, t in mine],
                    m.policy(),
                    micro_batch_size=2,
                    passes=m.micro_batch_count(count) if m.partitioned else None,
                )
            )
    result["scoring_close"] = all(torch.allclose(stats[0][k], stats[1][k], atol=1e-5) for k in stats[0])

    saved = out / "saved"
    part.save_weights(saved, write=world.rank == 0)
    world.barrier()
    reloaded = load_member(MemberConfig(id="r", model=str(saved), trainable=False)).model.state_dict()
    result["saved_equal"] = all(torch.equal(reloaded[k], t) for k, t in streamed.items())

    if use_vllm:
        rollout = RolloutConfig(
            engine="vllm", max_prompt_tokens=1024, max_new_tokens=8, vllm=VllmConfig(kv_cache_memory_bytes=32 << 20)
        )
        engine = make_engine("vllm", part, rollout)  # synced from the stream when built
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
        got = [g.responses[0].token_ids for g in engine.generate(prompts, greedy)]
        reference = load_member(MemberConfig(id="r", model=str(saved), trainable=False))
        ref_prompts = [
            Renderer(reference, "original", 10**6, 10**6)(ex) for ex in examples[world.rank * 3 : world.rank * 3 + 3]
        ]
        want = [g.responses[0].token_ids for g in make_engine("hf", reference).generate(ref_prompts, greedy)]
        result["vllm_equals_hf"] = got == want
    parts = world.all_gather(result)
    if world.rank == 0:
        (out / "result.json").write_text(json.dumps(parts))


if __name__ == "__main__":
    main()
    exit_process(0)  # past a rare abort in a ZeRO-3 C++ destructor at interpreter teardown (vlm_corl.train)

"""One process (gloo, a one-rank group): what DeepSpeed members compute in, as tests/test_deepspeed_precision.py
checks it. A ZeRO-2 member under train.mixed_precision=bf16, the same under `no`, then a ZeRO-3 one under bf16
(last: ZeRO-3 replaces torch's F.linear for the whole process), each updated once on fixed sequences.

    python tests/deepspeed_precision_worker.py MODEL_DIR OUT_DIR

Per member, OUT_DIR/result.json records the dtypes every Linear layer's output took in the update, whether an
autocast was already open when the engine's forward began (ours must not be: DeepSpeed opens its own), the
dtypes of the weights, of ZeRO's fp32 partitions and Adam's moments, of the gradient buckets (one per dtype the
gradients are reduced in), the update's `compute_dtype`, whether its loss is finite and whether the weights
changed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from vlm_corl.commands.train import exit_process
from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import AlgoConfig, RolloutConfig, TrainConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.distributed.world import build_groups, launch_world
from vlm_corl.members.deepspeed_update import GroupMPU, attach_deepspeed
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.update import Sequence, policy_update

ROOT = Path(__file__).resolve().parents[1]


def run_member(model: str, world, stage: int, mixed_precision: str) -> dict:
    """Build one DeepSpeed member, update it once, and report what it computed in."""
    train = TrainConfig(
        lr=1e-2,
        warmup_ratio=0.0,
        micro_batch_size=2,
        mixed_precision=mixed_precision,
        deepspeed=str(ROOT / "configs" / "deepspeed" / f"zero{stage}.json"),
    )
    m = load_member(MemberConfig(id="m", model=model), device=world.device, stage_on_cpu=stage == 3)
    m.group = world.group((0,))
    attach_deepspeed(m, train, 4, GroupMPU(m.group, world.singles[0]), keep_full_copy=False)
    before = {name: t.clone() for name, t in m.full_weights()}

    seen = {"linear": set(), "outer_autocast": set()}
    hooks = [
        mod.register_forward_hook(lambda mod, args, out: seen["linear"].add(str(out.dtype)))
        for mod in m.model.modules()
        if isinstance(mod, torch.nn.Linear)
    ]
    hooks.append(
        m.deepspeed.engine.register_forward_pre_hook(
            lambda mod, args: seen["outer_autocast"].add(torch.is_autocast_enabled(m.device.type))
        )
    )
    render = Renderer(m, "original", 10**6, 10**6)
    prompts = [render(ex) for ex in load_examples("easyvqa", split="train", limit=2).examples]
    seqs = [Sequence(p.inputs, [5, 6, 7, 8], advantage=a) for p in prompts for a in (1.0, -1.0)]
    stats = policy_update(m, seqs, AlgoConfig(), train, RolloutConfig(max_new_tokens=8))
    for hook in hooks:
        hook.remove()

    zero = m.deepspeed.optimizer
    masters = zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups
    return {
        "linear_outputs": sorted(seen["linear"]),
        "outer_autocast_at_engine": sorted(seen["outer_autocast"]),
        "compute_dtype": stats["compute_dtype"],
        "loss_finite": math.isfinite(stats["loss"]),
        "weights": sorted({str(p.dtype) for p in m.deepspeed.module.parameters()}),
        "masters": sorted({str(f.dtype) for f in masters}),
        "adam": sorted({str(zero.optimizer.state[f]["exp_avg"].dtype) for f in masters}),
        "gradient_buckets": sorted(str(d) for d in zero.ipg_buckets),
        "updated": any(not torch.equal(before[k], t) for k, t in m.full_weights()),
    }


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    world = launch_world(600, need_group=True)
    build_groups(world, {"m": (0,)}, every=True)
    result = {
        "zero2_bf16": run_member(model, world, 2, "bf16"),
        "zero2_no": run_member(model, world, 2, "no"),
        "zero3_bf16": run_member(model, world, 3, "bf16"),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
    exit_process(0)

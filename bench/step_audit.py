#!/usr/bin/env python3
"""Where one training step's work goes, on any machine: the FLOPs each phase executes against the ideal, the
operations that would make the host wait for a GPU, and the operators the decoder dispatches per token.

Prints ONE JSON object for one member (the zoo's tiny Qwen2-VL, built under --cache-dir) on real easy-vqa prompts
(the offline data the other benches use), P prompts x K responses of exactly T tokens (the end-of-sequence id is
a suppressed token, so no row ends early and every size decodes the same steps):

- rollout (`engines.hf.sample`, the eager decoding loop, a GPU's sync cadence: `sync_every` 8) and update
  (`update.policy_update`, no gradient checkpointing, one micro-batch of P x K rows):
  `flops` executed (torch.utils.flop_counter.FlopCounterMode: matrix products, convolutions and attention, forward
  and backward) and `ideal_flops`: the same counter over each sequence run alone (one prompt, one response, no
  padding, nothing shared), so `flops_over_ideal` is below 1 where running a prompt once for its K responses
  saves more than padding costs, and grows with padding;
- `syncs`: the operations that force a device-to-host sync on a GPU (a CPU has none, so they are counted), see
  SYNC_OPS and HOST_READS: aten._local_scalar_dense (Tensor.item, bool(), int(), float() of a tensor),
  aten.nonzero, aten.masked_select, aten.unique* (their output size depends on the data), indexing or
  index_put with a boolean mask (a nonzero inside), aten.repeat_interleave without output_size, and
  Tensor.tolist / .numpy / .cpu (a device-to-host copy); `sync_ops` names them with their counts;
- per decoded token (`rollout.per_step`: one decoding step, a token for every row, from the difference between a
  T- and a 2T-token rollout) the syncs and the aten operators dispatched; per micro-batch of the update
  (`update.per_micro_batch`, from the difference between 1 and P micro-batches of the same rows) the syncs;
  --rollout-is audits the update with that rollout correction (algo.rollout_is) against the rollout's log-probs.

    python bench/step_audit.py --size smallest      # a few seconds: tests/test_bench_step_audit.py runs it
    python bench/step_audit.py --size small
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)

import json  # noqa: E402
import tempfile  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

SIZES = {"smallest": {"prompts": 2, "k": 2, "tokens": 8}, "small": {"prompts": 4, "k": 4, "tokens": 16}}
GPU_SYNC_EVERY = 8  # `engines.hf.sync_every` on a GPU: the cadence audited here

aten = torch.ops.aten
# aten operators whose result the host must wait for on a GPU (a value, or an output size that depends on data)
SYNC_OPS = {
    aten._local_scalar_dense.default: "item/bool/int/float",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.repeat_interleave.Tensor: "repeat_interleave",
}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}  # a nonzero when a mask indexes
HOST_READS = {"tolist", "numpy", "cpu"}  # Tensor methods that copy to the host


class SyncCounter(TorchDispatchMode):
    """Counts the aten operators dispatched and, by name, those that would sync with a GPU (SYNC_OPS, boolean-mask
    indexing); `HostReads` adds the Tensor methods that copy to the host."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, Counter()
        self.paused = False  # True: count nothing (the optimizer's step: see `update`)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        self.ops += 1
        name = SYNC_OPS.get(func)
        if func is aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is not None:
            name = None
        if func in BOOL_INDEXED and any(_bool_mask(i) for i in (args[1] or ())):
            name = "boolean-mask indexing"
        if name:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


def _bool_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


class HostReads(TorchFunctionMode):
    """Counts Tensor.tolist / .numpy / .cpu into a `SyncCounter` (they dispatch no aten operator that would show
    them)."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor) and not self.counter.paused:
            self.counter.syncs[f"Tensor.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def audited():
    """Yields (the SyncCounter, {"flops", "ops", "syncs"} filled when the block ends)."""
    out: dict = {}
    flops, counter = FlopCounterMode(display=False), SyncCounter()
    with flops, counter, HostReads(counter):
        yield counter, out
    out.update(flops=flops.get_total_flops(), ops=counter.ops, syncs=dict(counter.syncs))


def _total(syncs: dict) -> int:
    return sum(syncs.values())


def build(args):
    """(member, rendered prompts) for the audit: the tiny zoo Qwen2-VL and `args.prompts` easy-vqa prompts."""
    from vlm_corl.config import MemberConfig
    from vlm_corl.data.loaders import load_examples
    from vlm_corl.members.member import load_member
    from vlm_corl.members.render import Renderer
    from vlm_corl.models.zoo import build_zoo, member_dir

    torch.manual_seed(0)
    path = member_dir(args.cache_dir, "qwen2_vl", "tiny")
    if not (path / "config.json").is_file():  # built once per cache directory
        build_zoo(args.cache_dir, families=["qwen2_vl"], size="tiny", seed=0)
    member = load_member(MemberConfig(id="audit", model=str(path)))
    render = Renderer(member, "original", 10**6, 10**6)
    prompts = [render(e) for e in load_examples("easyvqa", split="train", limit=args.prompts).examples]
    return member, prompts


def rollout(member, prompts, k: int, tokens: int):
    """`engines.hf.sample` as the engine runs it (no gradients, eager steps, a GPU's sync cadence), rows never
    ending early; returns ((tokens, the policy's log-probs) per row, the audit)."""
    from vlm_corl.members.engines import hf
    from vlm_corl.members.rollout import SamplingParams

    policy = member.policy(1.0)
    endings = hf.Endings([policy.suppressed[0]], member.tokenizer)  # a token never drawn: every row runs T steps
    params = SamplingParams(n=k, max_new_tokens=tokens, seed=1)
    every, hf.sync_every = hf.sync_every, lambda device: GPU_SYNC_EVERY
    try:
        with member.rollout_autocast(), torch.no_grad(), audited() as (_, audit):
            out = hf.sample(member.generation_module, [p.inputs for p in prompts], params, policy, endings,
                            hf.Decoding("off"))  # fmt: skip
    finally:
        hf.sync_every = every
    return list(zip(out[0], out[3])), audit


def update(member, seqs, micro_batch: int, rollout_is: str) -> dict:
    """One `policy_update` of `seqs` in micro-batches of `micro_batch`, audited, the optimizer's step left out: on a
    CPU its foreach AdamW reads its step counters (`item`), host tensors on a GPU too (and fused AdamW, CUDA's,
    reads none)."""
    from vlm_corl.config import AlgoConfig, TrainConfig
    from vlm_corl.config.schema import RolloutConfig
    from vlm_corl.members.update import policy_update

    train = TrainConfig(micro_batch_size=micro_batch)
    member.setup_optimizer(train, 10)
    with audited() as (counter, audit):
        member.optimizer.register_step_pre_hook(lambda *_: setattr(counter, "paused", True))
        member.optimizer.register_step_post_hook(lambda *_: setattr(counter, "paused", False))
        policy_update(member, seqs, AlgoConfig(rollout_is=rollout_is), train, RolloutConfig())
    return audit


def audit_step(args) -> dict:
    """The audit's JSON: see the module's docstring."""
    from vlm_corl.members.update import Sequence

    member, prompts = build(args)
    p, k, t = args.prompts, args.k, args.tokens
    rows, short = rollout(member, prompts, k, t)
    _, long = rollout(member, prompts, k, 2 * t)
    alone = sum(rollout(member, [prompt], 1, t)[1]["flops"] for prompt in prompts) * k
    seqs = [Sequence(prompts[i // k].inputs, ids, 0.5 + i, rollout_logprobs=logp) for i, (ids, logp) in enumerate(rows)]
    whole, split = (update(member, seqs, size, args.rollout_is) for size in (p * k, k))
    ideal = sum(update(member, [s], 1, args.rollout_is)["flops"] for s in seqs)
    return {
        "size": args.size,
        "model": "zoo qwen2_vl tiny",
        "P": p,
        "K": k,
        "T": t,
        "rollout_is": args.rollout_is,
        "rollout": _phase(short, alone)
        | {
            "per_step": {
                "syncs": (_total(long["syncs"]) - _total(short["syncs"])) / t,
                "operators": (long["ops"] - short["ops"]) / t,
            },
            "sync_every": GPU_SYNC_EVERY,
        },
        "update": _phase(whole, ideal)
        | {
            "micro_batches": 1,
            "per_micro_batch": {"syncs": (_total(split["syncs"]) - _total(whole["syncs"])) / (p - 1)},
        },
    }


def _phase(audit: dict, ideal: float) -> dict:
    return {
        "flops": audit["flops"],
        "ideal_flops": ideal,
        "flops_over_ideal": audit["flops"] / ideal,
        "syncs": _total(audit["syncs"]),
        "sync_ops": audit["syncs"],
        "operators": audit["ops"],
    }


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="smallest")
    parser.add_argument("--rollout-is", default="none", help="algo.rollout_is of the update (its correction's sums)")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "vlm_corl_step_audit"))
    args = parser.parse_args(argv)
    for key, value in SIZES[args.size].items():
        setattr(args, key, value)
    return args


def main(argv=None) -> None:
    torch.set_num_threads(1)
    print(json.dumps(audit_step(parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()

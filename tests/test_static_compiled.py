"""Issue 55 (R4-2, R4-3): a trained member's HF rollouts sample from its bf16 rollout copy, so the static decoder
runs over bf16 keys and values with no weight cast inside its step, under transformers 5.19 (the GPU stack's) as
under 5.25; the copy follows the fp32 masters at every sync, and the update and checkpoints keep the masters.

Rollouts are forced to bf16 on the CPU (`rollout.dtype: bfloat16`), the dtype CUDA's `auto` gives; the static step
is traced by dynamo (aot_eager, fullgraph) where a test needs the compiled graph, as mode reduce-overhead would be
on CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cohort_helpers import shipped_families
from safetensors.torch import load_file
from torch._functorch.aot_autograd import aot_module_simplified

import vlm_corl.members.engines.hf as hf
from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import TrainConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members import static_decode
from vlm_corl.members.batching import prefill
from vlm_corl.members.member import load_member
from vlm_corl.members.precision import rollout_dtype, samples_from_copy
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.training.run.slots import keep_rollout_copy

# families whose decoding state a static cache holds (Mllama: cross-attention; Gemma-3: sliding windows)
FAMILIES = [f for f in shipped_families() if f not in ("mllama", "gemma3")]
PARAMS = SamplingParams(n=2, max_new_tokens=6, seed=1, temperature=0.8)
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def fresh_static_state(monkeypatch):
    """No reason, refused shape or counted shape carried over from another test."""
    monkeypatch.setattr(static_decode, "fallback_reasons", [])
    monkeypatch.setattr(static_decode, "refused", {})
    monkeypatch.setattr(static_decode, "shapes", {})


@pytest.fixture(scope="module")
def examples():
    return load_examples("easyvqa", split="train", limit=2).examples


def trained(tiny_zoo, family: str, examples) -> tuple:
    """(a trained member of `family` rolling out in bf16 with its rollout copy, as the slots build it; its prompts)."""
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family])), rollout="bfloat16")
    keep_rollout_copy(member, "hf")
    text = member.family.modality != "vision"
    render = Renderer(member, "original", 10**6, 10**6)
    return member, [render(replace(e, images=()) if text else e) for e in examples]


def generate(member, prompts, mode: str, monkeypatch, record: list | None = None) -> list[list[int]]:
    """Token ids of every response of a rollout with the HF engine's static_cache `mode`; `record` collects the
    decoding steps it used."""
    made = static_decode.decode_steps

    def recorded(*args):
        steps = made(*args)
        (record if record is not None else []).append(steps)
        return steps

    monkeypatch.setattr(hf, "decode_steps", recorded)
    return [r.token_ids for g in hf.HFEngine(member, mode).generate(prompts, PARAMS) for r in g.responses]


def aot_eager(monkeypatch, graphs: list | None = None) -> None:
    """Compile the static step with dynamo (fullgraph, aot_eager: no inductor, the graph runs as traced); `graphs`
    collects each forward graph AOT autograd produced."""

    def backend(gm, example_inputs):
        def keep(g, inputs):
            (graphs if graphs is not None else []).append(g)
            return g

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep)

    torch._dynamo.reset()
    chosen = backend if graphs is not None else "aot_eager"
    monkeypatch.setattr(
        static_decode, "compile_step", lambda step, device: torch.compile(step, backend=chosen, dynamic=False,
                                                                          fullgraph=True)
    )  # fmt: skip


CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # the device types only: nothing is allocated on them


@pytest.mark.parametrize(
    "trainable,lora,stage,engine,device,checkpoint,setting,expected",
    [
        (True, False, None, "hf", CUDA, BF16, "auto", True),  # plain data parallel: fp32 masters, bf16 rollouts
        (True, False, 2, "hf", CUDA, FP32, "auto", True),  # ZeRO-2, an fp32 checkpoint
        (True, False, 3, "hf", CUDA, BF16, "auto", False),  # ZeRO-3: its engine keeps its own copy
        (True, True, None, "hf", CUDA, BF16, "auto", False),  # LoRA: the base is in its loaded dtype already
        (True, False, None, "vllm", CUDA, BF16, "auto", False),  # vLLM holds its own weights
        (False, False, None, "hf", CUDA, BF16, "auto", False),  # a frozen peer is cast once at load
        (True, False, None, "hf", CUDA, BF16, "float32", False),  # fp32 rollouts: nothing below the masters
        (True, False, None, "hf", CPU, FP32, "auto", False),  # a CPU rolls out in the checkpoint's fp32
        (True, False, None, "hf", CPU, BF16, "auto", True),  # ... or in its bf16, below the masters
        (True, False, None, "hf", CPU, FP32, "bfloat16", True),  # rollout.dtype forced to bf16
        (True, False, None, "hf", CUDA, FP32, "float16", True),
    ],
)
def test_which_trained_members_sample_from_a_rollout_copy(
    trainable, lora, stage, engine, device, checkpoint, setting, expected
):
    rollout = rollout_dtype(setting, device, checkpoint)
    assert samples_from_copy(trainable, lora, stage, engine, rollout, FP32) is expected


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trained_member_on_its_bf16_copy_decodes_statically_with_the_eager_loops_tokens(
    tiny_zoo, examples, family, monkeypatch
):
    """What a plain or ZeRO-2 trained member's HF rollout does on CUDA, here on the CPU in both transformers: it
    runs the bf16 copy (autocast off over it), caches bf16 keys and values, and the static path does not fall back
    (transformers 5.19 refused it over fp32 masters under autocast: values in the keys' fp32 dtype)."""
    member, prompts = trained(tiny_zoo, family, examples)
    copy = member.generation_module
    assert copy is member.rollout_copy and {p.dtype for p in copy.parameters()} == {BF16}
    assert {p.dtype for p in member.model.parameters()} == {FP32} and member.train_module is member.model
    assert member.rollout_autocast()._enabled is False  # a no-op over the bf16 copy
    with member.rollout_autocast(), torch.no_grad():
        prefix = prefill(copy, [p.inputs for p in prompts], member.tokenizer.pad_token_id, member.mrope)
    assert {(layer.keys.dtype, layer.values.dtype) for layer in prefix.cache.layers} == {(BF16, BF16)}
    steps = []
    static = generate(member, prompts, "on", monkeypatch, steps)
    assert static_decode.fallback_reasons == [] and steps[0].static
    layers = steps[0].bucket.cache.layers
    assert {(layer.keys.dtype, layer.values.dtype) for layer in layers} == {(BF16, BF16)}
    assert static == generate(member, prompts, "off", monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled(tiny_zoo, examples, family, monkeypatch):
    """The static step of every static family traced whole by dynamo over the trained member's bf16 copy, the
    engine kept across two rollouts: the eager loop's tokens both times, no fallback."""
    aot_eager(monkeypatch)
    member, prompts = trained(tiny_zoo, family, examples)
    engine = hf.HFEngine(member, "on")
    got = [[r.token_ids for g in engine.generate(prompts, PARAMS) for r in g.responses] for _ in range(2)]
    assert static_decode.fallback_reasons == []
    assert got[0] == got[1] == generate(member, prompts, "off", monkeypatch)


def test_no_weight_is_cast_inside_the_static_step(tiny_zoo, examples, monkeypatch):
    """R4-3: inside a compiled graph autocast casts every fp32 weight at every token (its weight cache does not
    exist there). Over the bf16 copy the step's graph casts no 2-D parameter input."""
    graphs = []
    aot_eager(monkeypatch, graphs)
    member, prompts = trained(tiny_zoo, "qwen2", examples)
    generate(member, prompts, "on", monkeypatch)
    assert static_decode.fallback_reasons == [] and graphs
    graph = graphs[0].graph
    inputs = {n.name for n in graph.nodes if n.op == "placeholder"}
    casts = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and ("convert_element_type" in str(n.target) or "_to_copy" in str(n.target))
        and getattr(n.args[0], "name", None) in inputs
        and n.args[0].meta["val"].dim() == 2
    ]
    assert casts == []


def test_the_copy_follows_the_masters_at_each_sync_and_checkpoints_keep_the_masters(
    tiny_zoo, examples, monkeypatch, tmp_path
):
    """After an update step the copy is stale until the engine's sync, then equals the masters cast to bf16, in
    the same tensors (captured graphs replay over them); the update ran on the fp32 masters, and a checkpoint
    saves the masters in the checkpoint's dtype (the zoo's fp32: exactly), not the copy."""
    member, prompts = trained(tiny_zoo, "qwen2", examples)
    member.setup_optimizer(TrainConfig(lr=1e-2, warmup_ratio=0.0), total_updates=4)
    copy = dict(member.rollout_copy.named_parameters())
    addresses = {name: p.data_ptr() for name, p in copy.items()}
    before = {name: p.detach().clone() for name, p in copy.items()}
    with member.autocast(member.train_module):
        loss = member.train_module(**prompts[0].inputs).logits.float().pow(2).mean()
    member.backward(loss)
    assert member.step(grad_clip=1.0)[1]
    masters = dict(member.model.named_parameters())
    assert all(copy[n].equal(before[n]) for n in copy)  # the update touched the masters alone
    assert not all(copy[n].equal(masters[n].to(BF16)) for n in copy)
    engine = hf.HFEngine(member, "on")
    engine.sync_weights()
    assert all(copy[n].equal(masters[n].detach().to(BF16)) for n in copy)
    assert {n: p.data_ptr() for n, p in copy.items()} == addresses
    member.save_weights(tmp_path / "best")
    saved = load_file(tmp_path / "best" / "model.safetensors")
    state = member.model.state_dict()
    assert all(saved[n].dtype == FP32 and saved[n].equal(state[n]) for n in saved)

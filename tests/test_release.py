"""A run gives back everything it took (vlm_corl.training.run.release): once `run_cohort` has returned or raised, no
member model, optimizer or DeepSpeed engine, rollout engine, HF rollout copy, EMA teacher, renderer (and the
prompts it cached), render thread or process group the run made is alive, for plain, LoRA, ZeRO-2 and ZeRO-3
members and for two runs in one process; an exception the caller keeps keeps none of them through its frames.
On CUDA the allocator's cache is emptied after the collection; a heap vLLM's engine froze is unfrozen once the
engines are built; a process group the caller made stays."""

from __future__ import annotations

import contextlib
import gc
import socket
import sys
import threading
import time
import traceback
import types
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from cohort_helpers import ROOT, cohort

from vlm_corl.api import CohortTrainer, RewardFunctionFailed
from vlm_corl.config import config_from_dict
from vlm_corl.distributed.world import CollectiveError
from vlm_corl.training import loop
from vlm_corl.training.phases import render_ahead
from vlm_corl.training.run import release
from vlm_corl.training.run import setup as run_setup
from vlm_corl.training.run import slots as slots_module
from vlm_corl.training.run.callbacks import CallbackFailed

KINDS = {
    "plain": {},
    "lora": {"lora": {"r": 4, "alpha": 8.0}},
    "zero2": {"deepspeed": "zero2"},
    "zero3": {"deepspeed": "zero3"},
}


def _config(tmp: Path, zoo: dict, kind: str, reward: dict | None = None) -> dict:
    """One tiny Qwen2-VL member of `kind`, 2 steps; rollouts in bf16 so that an EMA teacher (and a ZeRO-3 member
    with the HF engine) keeps a rollout copy."""
    cfg = cohort(
        tmp,
        [("q", zoo["qwen2_vl"])],
        data={"train": {"loader": "easyvqa", "limit": 8}, "batch_size": 2},
        rollout={"n": 2, "max_new_tokens": 4, "dtype": "bfloat16"},
        reward=reward or {"mode": "none", "custom": "reward_fixtures:shorter_is_better"},
    )
    cfg["train"]["max_steps"] = 2
    if "lora" in KINDS[kind]:
        cfg["members"][0]["lora"] = KINDS[kind]["lora"]
    if "deepspeed" in KINDS[kind]:
        cfg["train"]["deepspeed"] = str(ROOT / "configs" / "deepspeed" / f"{KINDS[kind]['deepspeed']}.json")
    return cfg


@pytest.fixture
def held(monkeypatch) -> dict[str, weakref.ref]:
    """Weak references to what each run started here holds (filled by `start_run` as it returns, and by
    `cache_prompts` with the prompts its renderers cached); the launch environment a DeepSpeed start writes
    (MASTER_PORT, RANK, ...) is put back after the test."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    refs: dict[str, weakref.ref] = {}
    real = loop.start_run

    def start_run(cfg, *args):
        # DeepSpeed's first import in a process (deepspeed 0.19.8, `deepspeed.utils.torch`) takes two references,
        # from C++, to the default process group alive then, which nothing gives back: only a group made after
        # that import can be seen to die (it is destroyed all the same: `_assert_given_back`).
        watch_world = "deepspeed.utils.torch" in sys.modules
        run = real(cfg, *args)
        n = sum(key.endswith(".renderer") for key in refs)  # a second run's slots get their own names
        for m in run.members:
            refs[f"{n}:{m.id}.model"] = weakref.ref(m.model)
            refs[f"{n}:{m.id}.optimizer"] = weakref.ref(m.optimizer)
            if m.deepspeed is not None:
                refs[f"{n}:{m.id}.deepspeed"] = weakref.ref(m.deepspeed.engine)
                if m.deepspeed.full_copy is not None:
                    refs[f"{n}:{m.id}.zero3_rollout_copy"] = weakref.ref(m.deepspeed.full_copy)
        for s in run.slots:
            refs[f"{n}:{s.id}.engine"] = weakref.ref(s.engine)
            refs[f"{n}:{s.id}.renderer"] = weakref.ref(s.renderer)
            refs[f"{n}:{s.id}.slot_model"] = weakref.ref(s.member.model)
            if s.member.rollout_copy is not None:
                refs[f"{n}:{s.id}.rollout_copy"] = weakref.ref(s.member.rollout_copy)
        for ranks, group in [*run.world.groups.items(), *run.world.singles.items()]:
            refs[f"{n}:group {ranks}"] = weakref.ref(group)
        if dist.is_initialized() and watch_world:
            refs[f"{n}:group WORLD"] = weakref.ref(dist.group.WORLD)
        return run

    monkeypatch.setattr(loop, "start_run", start_run)
    return refs


class CachePrompts:
    """A callback that, after each step, holds weak references to the prompts the run's renderers cached."""

    def __init__(self, refs: dict):
        self.refs = refs

    def on_step_end(self, step, rows):
        renderers = [r() for key, r in list(self.refs.items()) if key.endswith(".renderer")]
        for i, renderer in enumerate(r for r in renderers if r is not None):
            for j, prompt in enumerate(renderer.cached_prompts()):
                self.refs[f"prompt {step}.{i}.{j}"] = weakref.ref(prompt)


class RaisesAtStep1(CachePrompts):
    def on_step_end(self, step, rows):
        super().on_step_end(step, rows)
        raise RuntimeError("boom")


def _alive(refs: dict) -> list[str]:
    return sorted(key for key, ref in refs.items() if ref() is not None)


def _assert_given_back(refs: dict) -> None:
    """Everything recorded is dead (without a collection here: the release collected), no render thread is left,
    and the run's default process group is gone."""
    assert any(key.endswith(".model") for key in refs) and any(key.startswith("prompt") for key in refs)
    assert _alive(refs) == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("render")]
    assert not dist.is_initialized()


@pytest.mark.parametrize("kind", ["plain", "lora", "zero2", "zero3"])
def test_a_run_that_returns_leaves_nothing_alive(tiny_zoo, tmp_path, held, kind):
    loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, kind)), callbacks=[CachePrompts(held)])
    _assert_given_back(held)


@pytest.mark.parametrize("kind", ["plain", "lora", "zero2", "zero3"])
def test_a_run_a_callback_stops_leaves_nothing_alive_even_while_its_exception_is_kept(tiny_zoo, tmp_path, held, kind):
    with pytest.raises(CallbackFailed, match="boom") as caught:
        loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, kind)), callbacks=[RaisesAtStep1(held)])
    _assert_given_back(held)
    assert "in train_steps" in "".join(traceback.format_exception(caught.value))  # only the frames' locals went


def test_a_render_in_flight_when_the_run_stops_ends_before_the_release(tiny_zoo, tmp_path, held, monkeypatch):
    """The next batch renders in the background while a step runs: a run stopped mid-step waits for it (the
    render holds the run) instead of leaving the thread to finish after the release."""
    real = render_ahead.render_phase

    def slow_in_background(run, batch):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
        return real(run, batch)

    monkeypatch.setattr(render_ahead, "render_phase", slow_in_background)
    with pytest.raises(CallbackFailed):
        loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, "plain")), callbacks=[RaisesAtStep1(held)])
    _assert_given_back(held)


@pytest.mark.parametrize("raises", [False, True])
def test_trackers_are_finished_once_whether_the_run_returns_or_raises(tiny_zoo, tmp_path, held, monkeypatch, raises):
    """A run that raised finishes its trackers without a summary (W&B, MLflow runs no longer left open in the
    process, TensorBoard's writer threads ended); one that returned, once, with its summary."""
    finished = []

    class Tracker:
        def scalars(self, values, step): ...

        def samples(self, rows, step): ...

        def finish(self, summary):
            finished.append(None if summary is None else summary["steps"])

    monkeypatch.setattr(run_setup, "start_trackers", lambda *args: [Tracker()])
    callbacks = [RaisesAtStep1(held) if raises else CachePrompts(held)]
    with pytest.raises(CallbackFailed) if raises else contextlib.nullcontext():
        loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, "plain")), callbacks=callbacks)
    assert finished == ([None] if raises else [2])
    _assert_given_back(held)


def test_a_start_that_fails_after_the_members_loaded_leaves_nothing_alive(tiny_zoo, tmp_path, held, monkeypatch):
    """No run to release yet (a rollout engine that cannot start, say): the DeepSpeed engines already opened are
    closed all the same."""
    real = run_setup.load_hosted_members

    def load_hosted_members(*args):
        members = real(*args)
        held.update({f"{m.id}.model": weakref.ref(m.model) for m in members})
        held.update({f"{m.id}.deepspeed": weakref.ref(m.deepspeed.engine) for m in members})
        return members

    def build_slots(*args):
        raise RuntimeError("no room for the engine")

    monkeypatch.setattr(run_setup, "load_hosted_members", load_hosted_members)
    monkeypatch.setattr(run_setup, "build_slots", build_slots)
    with pytest.raises(RuntimeError, match="no room"):
        loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, "zero3")))
    assert held.keys() == {"q.model", "q.deepspeed"} and _alive(held) == []
    assert not dist.is_initialized()


def test_an_ema_teacher_and_its_rollout_copy_are_given_back_when_a_reward_function_raises(tiny_zoo, tmp_path, held):
    """co_rewarding_2 through the API: the teacher's fp32 model and its bf16 rollout copy, the member's, the
    engines and renderers of both slots; the reward function raises at the first step."""

    def failing(*, completions, **_):
        CachePrompts(held).on_step_end(1, [])  # the step's prompts are rendered and cached by now
        raise ValueError("no reward today")

    cfg = _config(tmp_path, tiny_zoo, "plain", reward={"mode": "co_rewarding_2"})
    with pytest.raises(RewardFunctionFailed, match="no reward today"):
        CohortTrainer(cfg, reward_funcs=[failing]).train()
    assert {"0:q.teacher.slot_model", "0:q.teacher.rollout_copy", "0:q.teacher.engine"} <= held.keys()
    _assert_given_back(held)


class Compiles(CachePrompts):
    """A callback that runs a compiled function after each step (what the HF engine's static decode steps do on
    CUDA, where dynamo's cudagraph trees keep a private memory pool)."""

    def __init__(self, refs: dict, compiled):
        super().__init__(refs)
        self.compiled, self.results = compiled, []

    def on_step_end(self, step, rows):
        super().on_step_end(step, rows)
        self.results.append(self.compiled(torch.full((2,), float(step))).tolist())


def test_two_runs_in_one_process_leave_nothing_of_either(tiny_zoo, tmp_path, held, monkeypatch):
    """A ZeRO-2 member's run, then a LoRA member's in the same process (the GPU report: the first run's 35 GB
    stayed, the second sat at 40 GB where its plan said 4.7): after each, nothing of either is alive, and dynamo
    was reset (R4-11: the cudagraph trees' pool outlived the run); code compiled in each run still runs right."""
    import torch._dynamo

    resets, real_reset = [], torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1) or real_reset())
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    first_run = Compiles(held, compiled)
    loop.run_cohort(config_from_dict(_config(tmp_path / "a", tiny_zoo, "zero2")), callbacks=[first_run])
    _assert_given_back(held)
    assert len(resets) == 1
    first = dict(held)
    second_run = Compiles(held, compiled)
    loop.run_cohort(config_from_dict(_config(tmp_path / "b", tiny_zoo, "lora")), callbacks=[second_run])
    assert len(held) > len(first)
    _assert_given_back(held)
    assert len(resets) == 2
    assert first_run.results == second_run.results == [[3.0, 3.0], [5.0, 5.0]]


def test_a_heap_the_engines_froze_is_unfrozen_once_they_are_built(tiny_zoo, tmp_path, held, monkeypatch):
    """vLLM's in-process engine core freezes the heap when built (gc.freeze): every trainer object alive then
    would escape the collector for good, so a ZeRO-2 member (whose engine and hooks form cycles) would stay."""
    real, frozen = slots_module.make_engine, []

    def freezing(*args, **kwargs):
        engine = real(*args, **kwargs)
        gc.freeze()
        frozen.append(gc.get_freeze_count())
        return engine

    monkeypatch.setattr(slots_module, "make_engine", freezing)
    started = loop.start_run

    def start_run(cfg, *args):
        run = started(cfg, *args)
        frozen.append(gc.get_freeze_count())
        return run

    monkeypatch.setattr(loop, "start_run", start_run)
    loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, "zero2")), callbacks=[CachePrompts(held)])
    assert frozen[0] > 0 and frozen[-1] == 0
    _assert_given_back(held)


def test_a_process_group_made_before_the_run_stays(tiny_zoo, tmp_path, held, monkeypatch):
    """The caller's (or accelerate's) default group is theirs: the run destroys only the groups it created."""
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**launch, "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mine = dist.group.WORLD
        loop.run_cohort(config_from_dict(_config(tmp_path, tiny_zoo, "zero2")), callbacks=[CachePrompts(held)])
        assert dist.is_initialized() and dist.group.WORLD is mine
        assert [key for key in _alive(held) if not key.endswith("group WORLD")] == []
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("raises", [False, True])
def test_on_cuda_the_release_empties_the_allocators_cache_after_collecting(monkeypatch, raises):
    """What the GPU report needed: the cached blocks of the run's freed tensors go back to the device."""
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(release.gc, "collect", lambda *args: events.append("collect") or 0)
    # R4-11: dynamo's reset frees the cudagraph trees' private pool, which empty_cache then hands back
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("dynamo reset"))
    with pytest.raises(ValueError) if raises else contextlib.nullcontext():
        with release.giving_back():
            if raises:
                raise ValueError("stopped")
    assert events == ["dynamo reset", "collect", "empty_cache"]


@pytest.mark.parametrize("failure", ["collective", "other"])
def test_a_group_whose_collectives_failed_is_left_to_the_process_exit(monkeypatch, failure):
    """When another rank died or hung (a CollectiveError, or the RankFailure raised from one), the run does not
    tear down the default group it made: NCCL may wait there for the collective that never completed. Any other
    failure destroys it as a return does."""
    state = {"initialized": False, "destroyed": 0}
    monkeypatch.setattr(release.dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(release.dist, "destroy_process_group", lambda: state.update(destroyed=state["destroyed"] + 1))
    monkeypatch.setattr(release, "release_engines", lambda: None)
    cause = CollectiveError("rank 1 stopped answering") if failure == "collective" else ValueError("a bug")
    with pytest.raises(RuntimeError):
        with release.giving_back():
            state["initialized"] = True  # the run made the default group
            raise RuntimeError("rank failure report") from cause
    assert state["destroyed"] == (0 if failure == "collective" else 1)


def test_a_launched_ranks_release_is_not_cut_short_by_the_launchers_stop(monkeypatch):
    """Once one rank of a launched run ends (a numerical stop ends every rank, one a little sooner), torchrun sends
    the others SIGTERM: a rank still giving back its memory then finishes and reports its own exit code and
    message (seen: rank 0 of a two-rank numerical stop killed mid-release, its message lost)."""
    import signal

    monkeypatch.setattr(release.dist, "is_initialized", lambda: True)
    before = signal.getsignal(signal.SIGTERM)
    with release.launcher_stop_ignored():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_interrupted_runs_frames_are_cleared_through_the_exceptions_context(monkeypatch):
    """Ctrl-C mid-step: the run raises Interrupted `from None`, which keeps the KeyboardInterrupt (and the frames
    it interrupted, with the tensors they hold) as its `__context__`. A caller that keeps the Interrupted keeps
    none of those tensors: the release clears the frames of the chained exceptions, context as well as cause."""
    from vlm_corl.errors import Interrupted

    refs = []

    def update() -> None:  # a step's frame, holding device tensors when the interrupt comes
        activations = torch.ones(64)
        refs.append(weakref.ref(activations))
        raise KeyboardInterrupt

    def run() -> None:
        try:
            update()
        except KeyboardInterrupt:
            raise Interrupted("interrupted at step 1 (update); no checkpoint was written yet") from None

    with pytest.raises(Interrupted) as kept:
        with release.giving_back():
            run()
    assert kept.value.__cause__ is None and isinstance(kept.value.__context__, KeyboardInterrupt)
    assert refs and [ref() for ref in refs] == [None]


class _Group:
    """A member's process group (only its identity matters here)."""


def _fake_run(slots: list) -> SimpleNamespace:
    groups = {(0, 1): _Group()}
    return SimpleNamespace(
        sink=None, members=["m"], slots=slots, world=SimpleNamespace(groups=groups, singles={(0,): _Group()})
    )


@pytest.mark.parametrize("failure", [None, "collective", "other"])
def test_a_run_destroys_its_member_groups_before_letting_its_slots_go_unless_its_collectives_failed(
    monkeypatch, failure
):
    """R4-5: `release_run` destroys the member groups while the slots (and their vLLM engines, whose collection
    would tear the groups down first) are still held, and not at all after a failed collective (NCCL's teardown
    may wait for the collective that never completed); nothing is destroyed once no group is initialized."""
    destroyed = []
    run = _fake_run(slots=["slot"])
    monkeypatch.setattr(release.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(release.dist, "destroy_process_group", lambda group=None: destroyed.append((group, run.slots)))
    groups = [*run.world.groups.values(), *run.world.singles.values()]
    cause = {"collective": CollectiveError("rank 1 stopped answering"), "other": ValueError("a bug")}.get(failure)
    with pytest.raises(RuntimeError) if failure else contextlib.nullcontext():
        try:
            if failure:
                raise RuntimeError("the run's failure") from cause
        finally:
            release.release_run(run)
    assert destroyed == ([] if failure == "collective" else [(g, ["slot"]) for g in groups])
    assert run.slots == [] and run.members == [] and run.world.groups == {}
    monkeypatch.setattr(release.dist, "is_initialized", lambda: False)  # torn down by someone else already
    destroyed.clear()
    release.release_run(_fake_run(slots=[]))
    assert destroyed == []


class _EngineCore:
    """vLLM 0.32's `EngineCore.shutdown`: its executor and scheduler, then `cleanup_dist_env_and_memory`,
    looked up by name in its module, which ends with `torch.distributed.destroy_process_group()`."""

    def shutdown(self) -> None:
        sys.modules["vllm.v1.engine.core"].cleanup_dist_env_and_memory()


class _InprocClient:
    """vLLM 0.32's in-process client: a finalizer shuts its engine core down when it is collected."""

    def __init__(self):
        self.engine_core = _EngineCore()
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)

    def shutdown(self) -> None:
        if self._finalizer.detach() is not None:
            self.engine_core.shutdown()


class _VLLMEngine:
    """A `VLLMEngine` as its release sees it (`_llm.llm_engine.engine_core`), open (as built) in this process."""

    def __init__(self, monkeypatch):
        from vlm_corl.members.engines import vllm as vllm_engines

        self._llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=_InprocClient()))
        vllm_engines._OPEN.add(self)
        core = types.ModuleType("vllm.v1.engine.core")
        core.cleanup_dist_env_and_memory = lambda shutdown_ray=False: dist.destroy_process_group()
        package = types.ModuleType("vllm.v1.engine")
        package.core = core
        for name, module in [("vllm", types.ModuleType("vllm")), ("vllm.v1", types.ModuleType("vllm.v1")),
                             ("vllm.v1.engine", package), ("vllm.v1.engine.core", core)]:  # fmt: skip
            monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("case", ["returned", "raised", "collective failed"])
def test_a_vllm_engine_tears_down_no_callers_group_and_no_group_after_a_failed_collective(monkeypatch, case):
    """R4-5: collected, a vLLM engine runs vLLM's teardown, which destroys the default process group. The
    release closes the engines first, without that teardown: a caller's default group (returned or raised)
    survives, the member groups are destroyed by the release itself; after a failed collective (the run made
    its group) no group at all is destroyed, by the release or by vLLM."""
    destroyed, made_before = [], case != "collective failed"
    state = {"initialized": made_before}
    monkeypatch.setattr(release.dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(release.dist, "destroy_process_group", lambda group=None: destroyed.append(group))
    run = _fake_run(slots=[_VLLMEngine(monkeypatch)])
    groups = [*run.world.groups.values(), *run.world.singles.values()]
    cause = CollectiveError("rank 1 stopped answering") if case == "collective failed" else None
    with pytest.raises(RuntimeError) if case != "returned" else contextlib.nullcontext():
        with release.giving_back():
            state["initialized"] = True
            try:
                if case != "returned":
                    raise RuntimeError("the run's failure") from cause
            finally:
                release.release_run(run)  # as the loop's finally does: the slots (the engine) let go
    assert destroyed == (groups if made_before else [])

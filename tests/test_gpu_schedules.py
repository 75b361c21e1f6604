"""What only a GPU would show, driven through the real loop on a CPU (issue 45, item 7): which weights an EMA
teacher samples from after the loop's sync, and which engines sleep, are pushed and wake around the update.

On a CPU an EMA teacher samples from its own fp32 module and no engine sleeps, so a loop that stopped refreshing
the teacher's rollout copy, or that left an engine asleep or its weights discarded, passes every other test. Here
the GPU's decisions are taken on the CPU: a bf16 rollout copy (rollout.dtype: bfloat16, the decision `auto` takes
on CUDA), or vLLM's engine with sleep mode on (a recording stand-in, tests/fake_vllm.py)."""

from __future__ import annotations

import sys

import pytest
import torch
from cohort_helpers import cohort
from fake_vllm import FakeLLM

from vlm_corl.config import config_from_dict
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.phases import update_phase
from vlm_corl.training.rewards.reward_funcs import RewardFunction

# reward.teacher_decay_start and _end: the teacher moves half way to its student at step 1 (decay 0.5, exact in
# binary), far enough that the move shows in bf16 as well
DECAY = {"teacher_decay_start": 0.5, "teacher_decay_end": 0.75}


def alternate(*, completions, **_):
    """A reward function that varies within every group (0, 1, 0, 1, ...): the student's advantages are never all
    zero, so its first update moves its weights whatever the tiny model answers."""
    return [float(i % 2) for i in range(len(completions))]


REWARDS = [RewardFunction(alternate, "alternate")]


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _lerp(start: dict, end: dict, weight: float) -> dict:
    """What `ema_update` makes of `start` moving toward `end`: start + weight * (end - start), tensor by tensor."""
    return {name: start[name].lerp(end[name], weight) for name in start}


def _unequal(a: dict, b: dict) -> list[str]:
    """The names of the tensors that differ between `a` and `b` (same names)."""
    return [name for name in a if not torch.equal(a[name], b[name])]


# ---- 1. the EMA teacher samples from the weights the EMA moved -------------------------------------------------


def test_an_ema_teachers_bf16_rollout_copy_holds_the_ema_weights_at_the_next_rollout(tiny_zoo, tmp_path, monkeypatch):
    """co_rewarding_2 with HF rollouts in bf16: the teacher samples from a bf16 copy of its fp32 weights, which
    the loop's sync refreshes after the update's EMA step. At step 2 that copy must hold bf16(teacher_0 +
    (1 - 0.5) (student_1 - teacher_0)), teacher_0 the student's initial weights and student_1 its weights after
    update 1; a loop that skipped the teacher's sync (or the refresh) would sample the initial weights again."""
    seen = []  # (member id, its fp32 weights, the weights its rollout samples from), at every rollout
    real = HFEngine.generate

    def recording(self, prompts, params):
        seen.append((self.member.id, _weights(self.member.model), _weights(self.member.generation_module)))
        return real(self, prompts, params)

    monkeypatch.setattr(HFEngine, "generate", recording)
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"])], reward={"mode": "co_rewarding_2", **DECAY})
    cfg["rollout"]["dtype"] = "bfloat16"  # what rollout.dtype auto decides on CUDA: a bf16 copy for the teacher
    run_cohort(config_from_dict(cfg), reward_funcs=REWARDS)

    student = [(fp32, served) for mid, fp32, served in seen if mid == "a"]
    teacher = [(fp32, served) for mid, fp32, served in seen if mid == "a.teacher"]
    assert len(student) == len(teacher) == 2  # one rollout a step
    (start, first_copy), (_, second_copy) = teacher
    assert {t.dtype for t in [*first_copy.values(), *second_copy.values()]} == {torch.bfloat16}  # the GPU's copy
    assert _unequal(student[1][0], student[0][0])  # update 1 moved the student
    ema = _lerp(start, student[1][0], 1 - 0.5)  # decay 0.5 at step 0
    expected = {name: w.to(torch.bfloat16) for name, w in ema.items()}
    assert not _unequal(first_copy, {name: w.to(torch.bfloat16) for name, w in start.items()})
    assert _unequal(second_copy, first_copy)  # the move shows in bf16
    assert not _unequal(second_copy, expected)


class RecordingLLM(FakeLLM):
    """The stand-in keeping what a real engine's memory would hold: a copy of every push (vLLM copies what it
    is given), which push each generate sampled from, and whether it sleeps; it refuses to generate while any of
    its memory sleeps (vLLM would sample from released memory). `timeline` is every engine's calls in order, with
    the loop's updates, shared by the test."""

    timeline: list = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pushes, self.sampled, self.asleep = [], [], set()

    def _event(self, call) -> None:
        RecordingLLM.timeline.append((FakeLLM.instances.index(self), call))

    def collective_rpc(self, method, kwargs=None):
        if method != "reload_weights":
            return super().collective_rpc(method, kwargs)
        pushed = {}

        def copied(weights):
            for name, tensor in weights:
                pushed[name] = tensor.detach().clone()
                yield name, tensor

        super().collective_rpc(method, {"weights_iterator": copied(kwargs["weights_iterator"])})
        self.pushes.append(pushed)
        self._event("push")

    def generate(self, requests, sampling, **kwargs):
        if self.asleep:
            raise AssertionError(f"generate while {sorted(self.asleep)} sleep")
        self.sampled.append(len(self.pushes) - 1)
        self._event("generate")
        return super().generate(requests, sampling, **kwargs)

    def sleep(self, level):
        super().sleep(level)
        self.asleep = {"weights", "kv_cache"}
        self._event(("sleep", level))

    def wake_up(self, tags):
        super().wake_up(tags)
        self.asleep -= set(tags)
        self._event(("wake_up", tuple(tags)))


@pytest.fixture
def recording_vllm(fake_vllm, monkeypatch):
    """vllm.LLM replaced by RecordingLLM (the stand-in reads no image prompt: its token check is off, as in
    tests/test_engine_phases.py); the loop's updates are written into the same timeline."""
    from vlm_corl.members.engines.vllm import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "_check_prompt_ids", lambda self, prompts, outputs: None)
    monkeypatch.setattr(sys.modules["vllm"], "LLM", RecordingLLM)
    RecordingLLM.timeline = []
    real = update_phase.policy_update

    def update(member, *args, **kwargs):
        RecordingLLM.timeline.append((member.id, "update"))
        return real(member, *args, **kwargs)

    monkeypatch.setattr(update_phase, "policy_update", update)
    return RecordingLLM.timeline


def test_an_ema_teacher_on_vllm_samples_from_the_ema_weights_pushed_at_the_sync(tiny_zoo, tmp_path, recording_vllm):
    """co_rewarding_2 on vLLM: the teacher's engine gets its weights only by pushes. Its step-2 rollout must
    sample from the push of step 1's sync, holding teacher_0 + (1 - 0.5) (student_1 - teacher_0) exactly (the
    fp32 weights vLLM casts itself), teacher_0 its build's push and student_1 the student's push at that sync."""
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"])], reward={"mode": "co_rewarding_2", **DECAY})
    cfg["members"][0]["engine"] = "vllm"
    run_cohort(config_from_dict(cfg), reward_funcs=REWARDS)

    student, teacher = FakeLLM.instances  # built in that order (members, then teachers)
    assert len(student.pushes) == len(teacher.pushes) == 3  # the build's, then one per sync
    assert student.sampled == teacher.sampled == [0, 1]  # each rollout samples the latest push
    assert _unequal(student.pushes[1], student.pushes[0])
    assert _unequal(teacher.pushes[1], teacher.pushes[0])
    assert not _unequal(teacher.pushes[1], _lerp(teacher.pushes[0], student.pushes[1], 1 - 0.5))


# ---- 2. which engines sleep for the update ---------------------------------------------------------------------


def _schedule(timeline: list, engine: int) -> list:
    """One engine's calls with the loop's updates between them."""
    return [call for who, call in timeline if who == engine or call == "update"]


@pytest.mark.parametrize("on_vllm", ["trained", "frozen"])
def test_each_engine_sleeps_for_the_update_and_only_a_trained_members_is_pushed(
    tiny_zoo, tmp_path, recording_vllm, on_vllm
):
    """Sleep mode on, a trained member and a frozen peer in one process (vLLM allows one sleeping engine per
    process: the one on vLLM, Qwen2-VL, is `on_vllm`, the other on the HF engine). The trained member's engine
    sleeps at level 2 before its update and is pushed, then woken, after it. The frozen peer's engine sleeps too
    (the memory plan frees every engine for the update and backs a frozen peer's weights up on the host:
    planning/cohort.py, planning/host.py), at level 1, which keeps its weights: it is never pushed after the build
    (its weights never change) and wakes after the update. The stand-in raises on any generate while asleep."""
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])])  # vLLM cannot run Mllama
    cfg["members"][0]["engine"], cfg["members"][1]["engine"] = "vllm", "hf"
    cfg["members"][0 if on_vllm == "frozen" else 1]["trainable"] = False
    cfg["rollout"]["vllm"] = {"enable_sleep_mode": True}
    run_cohort(config_from_dict(cfg), reward_funcs=REWARDS)

    (engine,) = FakeLLM.instances
    assert "GARBAGE" not in engine.calls  # never sampled from discarded weights
    assert engine.shut_down  # by the release, not left to vLLM's finalizer (R4-5)
    assert [call for who, call in recording_vllm if call == "update"] == ["update", "update"]  # once a step
    if on_vllm == "trained":
        step = ["generate", ("sleep", 2), "update", ("wake_up", ("weights",)), "push", ("wake_up", ("kv_cache",))]
    else:
        step = ["generate", ("sleep", 1), "update", ("wake_up", ("kv_cache", "weights"))]
    assert _schedule(recording_vllm, 0) == ["push", *step, *step]  # the build's push, two steps

"""The sleep/wake cycle of vLLM engines, driven by the real loop phases on a pretend CUDA machine (a recording
stand-in for `vllm`, tests/fake_vllm.py): engines sleep only for the update, wake after the sync, and never
generate from weights a level-2 sleep discarded: not in the rollouts, not in an in-loop evaluation of several
batches, not in co_rewarding_1's second view. And the rollout guard that would catch such a bug."""

from __future__ import annotations

import json

import pytest
from cohort_helpers import cohort, metrics
from fake_vllm import FakeLLM

from vlm_corl.config import config_from_dict
from vlm_corl.evaluation import scoring
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.run.numerics import RolloutMismatchStopped, check_rollout_mismatch

GEN = ("generate", {"add_special_tokens": False})
SLEEP_SYNC_WAKE = [("sleep", 2), ("wake_up", ("weights",)), "push", ("wake_up", ("kv_cache",))]


@pytest.fixture
def fake_engine(fake_vllm, monkeypatch):
    """The stand-in reads no image prompt: its token check (tests/test_gpu_paths.py, the vLLM lane) is off."""
    from vlm_corl.members.engines.vllm import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "_check_prompt_ids", lambda self, prompts, outputs: None)


def _vllm_cohort(tmp_path, zoo, **sections):
    cfg = cohort(tmp_path, [("a", zoo["qwen2_vl"]), ("b", zoo["mllama"])], **sections)
    cfg["members"][0]["engine"], cfg["members"][1]["engine"] = "vllm", "hf"  # one engine in the process: it sleeps
    cfg["rollout"]["vllm"] = {"enable_sleep_mode": True}
    return cfg


def test_engines_sleep_for_the_update_only_and_evaluations_run_on_pushed_weights(tiny_zoo, tmp_path, fake_engine):
    """eval at step 0 (2 batches) → rollout → update (asleep) → sync → wake → eval (2 batches) → next rollout."""
    scoring_batch, scoring.EVAL_BATCH = scoring.EVAL_BATCH, 2
    try:
        cfg = _vllm_cohort(
            tmp_path, tiny_zoo, eval={"benchmarks": ["easyvqa"], "every": 1, "limit": 4, "max_new_tokens": 4}
        )
        run_cohort(config_from_dict(cfg))
    finally:
        scoring.EVAL_BATCH = scoring_batch
    calls = FakeLLM.instances[0].engine_calls()
    assert "GARBAGE" not in calls
    step = [GEN, *SLEEP_SYNC_WAKE, GEN, GEN]  # rollout, update and sync, in-loop eval of two batches
    assert calls == ["push", GEN, GEN, *step, *step]  # the build's push, the step-0 eval, two steps
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["environment"]["vllm_model_runners"] == ["vllm.v1.worker.gpu_model_runner.GPUModelRunner"]


def test_co_rewarding_1s_two_views_share_an_awake_engine(tiny_zoo, tmp_path, fake_engine):
    cfg = _vllm_cohort(tmp_path, tiny_zoo, reward={"mode": "co_rewarding_1"})
    cfg["data"]["view_fallback"] = "original"
    run_cohort(config_from_dict(cfg))
    calls = FakeLLM.instances[0].engine_calls()
    assert "GARBAGE" not in calls
    assert calls == ["push", *[GEN, GEN, *SLEEP_SYNC_WAKE] * 2]


def test_the_rollout_guard_stops_at_the_first_step_an_engine_serves_other_weights(tiny_zoo, tmp_path, monkeypatch):
    """An engine whose log-probs are far from the policy's (what rollouts from discarded or half-pushed weights
    look like) stops the run at that step, naming the member, before the step's checkpoint."""
    real = HFEngine.generate

    def drifted(self, prompts, params):
        groups = real(self, prompts, params)
        if self.member.id == "b":
            for g in groups:
                for r in g.responses:
                    r.token_logprobs = [lp - 3.0 for lp in r.token_logprobs]
        return groups

    monkeypatch.setattr(HFEngine, "generate", drifted)
    # a continuous reward: every group has advantages, so the update forwards (and compares) every response
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])], reward={"mode": "self_certainty"})
    cfg["algo"] = {"rollout_is": "token_truncated"}
    cfg["train"].update(save_every=1)
    with pytest.raises(RolloutMismatchStopped, match=r"at step 1 member 'b'.s rollout engine .* 3 nats per token"):
        run_cohort(config_from_dict(cfg))
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_the_rollout_guards_message_names_the_ways_out():
    """A family whose engine loses state in vLLM's level-2 sleep (vLLM restores only named buffers) passes at
    sleep level 1; any engine trouble passes with the HF engine."""
    with pytest.raises(RolloutMismatchStopped, match=r"rollout\.vllm\.sleep_level: 1 .*members\[i\]\.engine: hf"):
        check_rollout_mismatch(4, {"a": {"is_abs_dlogp": 2.0}}, 1.0, None)


def test_the_rollout_guard_passes_matching_engines_and_is_off_at_zero(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])], reward={"mode": "self_certainty"})
    cfg["algo"] = {"rollout_is": "token_truncated"}
    run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    assert all(0 <= r["is_abs_dlogp"] < 1e-3 for r in rows)  # the HF engine samples from the policy itself
    check_rollout_mismatch(1, {"a": {"is_abs_dlogp": 50.0}}, 0.0, None)  # 0: never stops


@pytest.mark.parametrize("recipe", ["gpu_1node_3vlm.yaml", "gpu_1gpu_2vlm.yaml"])
def test_the_gpu_recipes_compare_every_rollout_with_the_policy(recipe):
    """Both GPU recipes keep the engine's log-probs and stop on a mismatch (the guard above): a vLLM engine
    serving other weights than the trainer's shows at the first step it happens."""
    from pathlib import Path

    from vlm_corl.config import read_raw_config
    from vlm_corl.config.schema import AlgoConfig

    raw = read_raw_config(Path(__file__).resolve().parents[1] / "configs" / "cohorts" / recipe)
    assert raw["algo"]["rollout_is"] == "token_truncated"
    assert raw["algo"].get("rollout_is_max_abs_dlogp", AlgoConfig().rollout_is_max_abs_dlogp) > 0

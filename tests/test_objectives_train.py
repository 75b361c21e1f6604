"""Each policy objective (algo.policy_loss) and each rollout correction (algo.rollout_is) trains a tiny member for
two steps through the whole loop: the loss is finite, the weights move, and a correction logs the share of tokens
and sequences its cap truncated or masked. Two optimizer passes per batch, so the second pass is off-policy and
each objective's clip, weight or gate acts (on fresh rollouts every objective is the plain policy gradient).
Their maths is worked by hand in tests/test_grpo_objectives.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from cohort_helpers import cohort, metrics, weights, write_jsonl

from vlm_corl.config import ConfigError, config_from_dict
from vlm_corl.experiments import easyvqa_try
from vlm_corl.experiments.easyvqa_design import Method
from vlm_corl.training.loop import run_cohort

OPTIONS = [
    *({"policy_loss": p} for p in ("grpo", "gspo", "cispo", "sapo")),
    *({"rollout_is": m} for m in ("token_truncated", "token_mask", "sequence_truncated", "sequence_mask")),
]


def _run(tmp_path: Path, model: Path, algo: dict) -> tuple[list[dict], dict]:
    """Two steps of one tiny text member, two optimizer passes per batch; (metrics rows, final weights)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"q{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)]
    data = {"train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", rows))}, "batch_size": 2}
    cfg = cohort(
        tmp_path,
        [("m", model)],
        data=data,
        reward={"mode": "none", "custom": "reward_fixtures:shorter_is_better"},
        algo={**algo, "updates_per_batch": 2},
    )
    resolved = config_from_dict(cfg)
    assert all(getattr(resolved.algo, k) == v for k, v in algo.items())
    summary = run_cohort(resolved)
    return metrics(tmp_path / "run"), weights(Path(summary["checkpoint"]) / "m")


@pytest.mark.parametrize("algo", OPTIONS, ids=lambda a: "=".join(*a.items()))
def test_a_two_step_run_trains_with_each_objective_and_correction(tiny_zoo, tmp_path, algo):
    logged, after = _run(tmp_path, tiny_zoo["qwen3"], algo)
    assert len(logged) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logged)
    before = weights(tiny_zoo["qwen3"])
    assert any(not torch.equal(after[k], before[k]) for k in before), "no parameter changed"
    if "rollout_is" in algo:
        # the HF engine samples from the policy itself: nothing near the cap
        assert all(r["is_capped_frac"] == 0.0 and r["is_capped_seq_frac"] == 0.0 for r in logged)
        assert all(r["is_abs_dlogp"] < 1e-3 for r in logged)


def test_the_objective_reaches_the_update(tiny_zoo, tmp_path):
    """The same run under grpo and under gspo (its clip of 3e-4 / 4e-4 on the sequence ratio acts in the second,
    off-policy pass) ends with other weights."""
    _, grpo = _run(tmp_path / "grpo", tiny_zoo["qwen3"], {"policy_loss": "grpo"})
    _, gspo = _run(tmp_path / "gspo", tiny_zoo["qwen3"], {"policy_loss": "gspo"})
    assert any(not torch.equal(grpo[k], gspo[k]) for k in grpo)


def test_the_experiment_harness_selects_an_objective_and_its_run_trains(tiny_zoo, tmp_path):
    """`corl experiment-try ... algo.policy_loss=gspo algo.rollout_is=sequence_mask`: the overrides reach every run's
    config (a misspelt objective is refused naming the choices), and such a run trains."""
    method = Method(name="gt (labels)", mode="gt", cohort="q", runs=((("q", "qwen2_vl", "original", True),),), seeds=1)
    bases = tiny_zoo["qwen2_vl"].parent  # the experiment's base folder holds one model folder per base
    overrides = ["algo.policy_loss=gspo", "algo.rollout_is=sequence_mask", "train.max_steps=1", "data.batch_size=2"]
    overrides += ["rollout.n=2", "rollout.max_new_tokens=4"]
    (cfg,) = easyvqa_try.try_configs(method, bases, 0, tmp_path, overrides)
    assert cfg["algo"] == {"policy_loss": "gspo", "rollout_is": "sequence_mask"}
    run_cohort(config_from_dict(cfg))
    (row,) = metrics(Path(cfg["output_dir"]))
    assert math.isfinite(row["loss"]) and row["is_capped_seq_frac"] == 0.0
    with pytest.raises(ConfigError, match="algo.policy_loss: 'gpso' is not valid; choose one of: grpo, gspo, cispo"):
        easyvqa_try.try_configs(method, bases, 0, tmp_path, ["algo.policy_loss=gpso"])

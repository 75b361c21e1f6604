"""Each policy objective (algo.policy_loss) and each rollout correction (algo.rollout_is) trains a tiny member for
two steps through the whole loop: the loss is finite, the weights move, and a correction logs the share of tokens
and sequences its cap truncated or masked. Two optimizer passes per batch, so the second pass is off-policy and
each objective's clip, weight or gate acts (on fresh rollouts every objective is the plain policy gradient).
Their maths is worked by hand in tests/test_grpo_objectives.py. The grpo, gspo and cispo runs also anchor to the
reference (algo.kl_beta) and run three steps: every row logs the numbers researchers read first (docs/metrics.md),
grpo's with the rollout correction and dynamic sampling on, their fields too; tests/test_metrics_fields.py checks
their values by hand."""

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

KL = {"kl_beta": 0.05}
OPTIONS = [
    {"policy_loss": "grpo", **KL, "rollout_is": "token_truncated", "resample_zero_variance": True},
    *({"policy_loss": p, **KL} for p in ("gspo", "cispo")),
    {"policy_loss": "sapo"},
    *({"rollout_is": m} for m in ("token_mask", "sequence_truncated", "sequence_mask")),
]
BATCH, K, MAX_NEW = 2, 4, 8  # the runs' questions per step, responses per question, length budget (cohort())


def _run(tmp_path: Path, model: Path, algo: dict) -> tuple[list[dict], dict]:
    """Two steps (three with algo.kl_beta) of one tiny text member, two optimizer passes per batch; (metrics rows,
    final weights)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"q{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)]
    data = {"train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", rows))}, "batch_size": BATCH}
    steps = 3 if "kl_beta" in algo else 2
    train = {"max_steps": steps, "lr": 1e-3, "save_every": 0, "warmup_ratio": 0.0}
    cfg = cohort(
        tmp_path,
        [("m", model)],
        data=data,
        reward={"mode": "none", "custom": "reward_fixtures:shorter_is_better"},
        algo={**algo, "updates_per_batch": 2},
        train=train,
    )
    resolved = config_from_dict(cfg)
    assert all(getattr(resolved.algo, k) == v for k, v in algo.items())
    summary = run_cohort(resolved)
    return metrics(tmp_path / "run"), weights(Path(summary["checkpoint"]) / "m")


@pytest.mark.parametrize("algo", OPTIONS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()))
def test_a_short_run_trains_with_each_objective_and_correction_and_logs_its_figures(tiny_zoo, tmp_path, algo):
    logged, after = _run(tmp_path, tiny_zoo["qwen3"], algo)
    assert len(logged) == (3 if "kl_beta" in algo else 2)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logged)
    _assert_researcher_fields(logged, algo)
    before = weights(tiny_zoo["qwen3"])
    assert any(not torch.equal(after[k], before[k]) for k in before), "no parameter changed"
    if "rollout_is" in algo:
        # the HF engine samples from the policy itself: nothing near the cap
        assert all(r["is_capped_frac"] == 0.0 and r["is_capped_seq_frac"] == 0.0 for r in logged)
        assert all(r["is_abs_dlogp"] < 1e-3 for r in logged)
        # the weight before the cap: the engine is the policy, every ratio about 1
        assert all(r["is_ratio_min"] <= r["is_ratio_mean"] <= r["is_ratio_max"] for r in logged)
        assert all(abs(r[k] - 1) < 1e-3 for r in logged for k in ("is_ratio_min", "is_ratio_max"))


def _assert_researcher_fields(rows: list[dict], algo: dict) -> None:
    """Every row holds the fields of docs/metrics.md with sane values: the clip fractions at the objective's level
    (a whole number of tokens, gspo: of sequences, over 2 passes; none under sapo; cispo caps from above only), the
    KL to the reference only with algo.kl_beta, the entropy, the length spread and the shares."""
    objective = algo.get("policy_loss", "grpo")
    for r in rows:
        assert r["response_len_min"] <= r["response_len"] <= r["response_len_max"] <= MAX_NEW
        assert 0.0 <= r["truncated_frac"] <= 1.0 and (r["truncated_frac"] == 0 or r["response_len_max"] == MAX_NEW)
        assert 0.0 <= r["zero_variance_frac"] <= 1.0 and 0.0 < r["entropy"] < 20.0
        if "resample_zero_variance" in algo:  # rounds only replace flat groups: the share can only fall
            assert r["zero_variance_frac"] <= r["zero_variance_frac_before"] <= 1.0
        if objective == "sapo":
            assert r["clip_frac"] is r["clip_frac_low"] is r["clip_frac_high"] is None
            continue
        assert r["clip_frac"] == pytest.approx(r["clip_frac_low"] + r["clip_frac_high"]) and r["clip_frac"] <= 1.0
        units = 2 * BATCH * K if objective == "gspo" else 2 * round(r["response_len"] * BATCH * K)
        assert r["clip_frac"] * units == pytest.approx(round(r["clip_frac"] * units), abs=1e-6)
        assert objective != "cispo" or r["clip_frac_low"] == 0.0
        assert (r["kl"] is None) == ("kl_beta" not in algo)
    if objective == "gspo":  # its clip of 3e-4 / 4e-4 on the sequence ratio binds in the second pass
        assert any(r["clip_frac"] > 0 for r in rows)
    if "kl_beta" in algo:  # k3 >= 0 up to float32 rounding; the policy leaves the reference from the first step
        assert all(r["kl"] > -1e-6 for r in rows) and rows[-1]["kl"] > 0


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

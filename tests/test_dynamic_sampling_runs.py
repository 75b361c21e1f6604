"""DAPO's dynamic sampling (algo.resample_zero_variance) and overlong shaping (algo.overlong_penalty,
algo.overlong_penalty_factor, algo.mask_truncated) in the loop: the config's check of the window, the loss
normaliser and the sequences with masked responses (by hand), a 2-step tiny run per option (finite loss, weights
change), the questions a run trained on after resampling against a replay of the data stream, an exact resume of a
run that resamples, and the experiment harness selecting them. The pure maths: tests/test_dynamic_sampling.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cohort_helpers import cohort, metrics, trained_fields, weights

from vlm_corl.config import ConfigError, config_from_dict
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.experiments import easyvqa_try
from vlm_corl.experiments.easyvqa_design import Method
from vlm_corl.members.update import policy_update
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.phases import update_phase
from vlm_corl.training.phases.update_phase import _sequences, batch_totals
from vlm_corl.training.run.setup import load_training_examples

# ---- the config -----------------------------------------------------------------------------------------


def test_the_overlong_window_must_fit_the_budget(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"})
    cfg["algo"] = {"overlong_penalty": 9}
    with pytest.raises(ConfigError, match=r"algo.overlong_penalty: the overlong window \(9 tokens\) is longer"):
        config_from_dict(cfg)
    cfg["algo"] = {"overlong_penalty": 8}  # rollout.max_new_tokens: the whole budget
    config_from_dict(cfg)


# ---- masking truncated responses ------------------------------------------------------------------------


def test_masked_responses_leave_the_loss_normaliser():
    """Two slots of one member (B = 2, K = 2). Unmasked, unfiltered: 19 tokens in 8 responses. Masking slot 0's
    first response (3 tokens) and slot 1's last (0 tokens): 16 tokens in 6. With the zero-variance filter only
    slot 0's first group ([3, 1], rewards 1, 0) and slot 1's second ([1, 0], rewards 0, 1) count, 5 tokens in 4
    responses; with the mask as well: 1 + 1 tokens in 2."""
    lengths = [[[3, 1], [2, 2]], [[5, 5], [1, 0]]]
    rewards = [torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 0.0], [0.0, 1.0]])]
    masked = [[[True, False], [False, False]], [[False, False], [False, True]]]
    assert batch_totals(lengths, rewards, False, masked) == (16, 6)
    assert batch_totals(lengths, rewards, True) == (5, 4)
    assert batch_totals(lengths, rewards, True, masked) == (2, 2)


def test_masked_responses_are_marked_untrained():
    response = SimpleNamespace(token_ids=[1, 2], token_logprobs=None)
    groups = [SimpleNamespace(prompt=SimpleNamespace(inputs={}), responses=[response, response]) for _ in range(2)]
    cfg = SimpleNamespace(algo=SimpleNamespace(filter_zero_variance=False))
    advantages, rewards = torch.tensor([[1.0, -1.0], [0.5, -0.5]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    seqs = _sequences(groups, range(2), advantages, rewards, cfg, [[False, True], [True, False]])
    assert [s.trained for s in seqs] == [True, False, False, True]
    assert [s.advantage for s in seqs] == [1.0, -1.0, 0.5, -0.5]  # the advantages are computed with them
    assert all(s.trained for s in _sequences(groups, range(2), advantages, rewards, cfg))


# ---- tiny runs ------------------------------------------------------------------------------------------

OPTIONS = {
    "resample": {"resample_zero_variance": True},
    "overlong": {"overlong_penalty": 4, "overlong_penalty_factor": 0.5},
    "mask_truncated": {"mask_truncated": True},
}


def _config(tiny_zoo, tmp_path: Path, algo: dict, max_steps: int = 2, reward="zero_variance_on_yes_no") -> dict:
    """Two trained members; the reward (reward_fixtures.zero_variance_on_yes_no) is flat on every yes/no question
    and varies on every other one; the stop string "e" ends some responses early, the others are cut at 8."""
    cfg = cohort(
        tmp_path,
        [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])],
        reward={"mode": "none", "custom": f"reward_fixtures:{reward}"},
        algo=algo,
    )
    cfg["rollout"]["stop"] = ["e"]
    cfg["train"]["max_steps"] = max_steps
    cfg["logging"].update(samples_every=1, samples_per_step=4)
    return cfg


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_two_step_tiny_run_trains_with_the_option(tiny_zoo, tmp_path, option):
    cfg = _config(tiny_zoo, tmp_path, OPTIONS[option])
    summary = run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    for mid, family in (("q", "qwen2_vl"), ("l", "mllama")):
        before, after = weights(tiny_zoo[family]), weights(Path(summary["checkpoint"]) / mid)
        assert any(not torch.equal(before[k], after[k]) for k in before), f"{option}: {mid} did not change"
    if option == "overlong":  # the mean reward is the function's plus 0.5 x the mean penalty
        for r in rows:
            assert -1.0 <= r["reward_overlong"] < 0.0 and 0.0 < r["truncated_frac"] <= 1.0
            shaped = r["reward_zero_variance_on_yes_no"] + 0.5 * r["reward_overlong"]
            assert r["reward_mean"] == pytest.approx(shaped, abs=1e-5)
    if option == "mask_truncated":
        assert all(0.0 < r["truncated_frac"] < 1.0 for r in rows)


def test_masking_truncated_responses_trains_on_fewer_tokens(tiny_zoo, tmp_path, monkeypatch):
    """Step 1 samples the same responses with or without the mask (same weights, same seeds): masked, the update
    runs through fewer tokens (the cut responses are left out), and some (shorter_is_better: every group varies).
    What the update phase hands each member's update, recorded: masked, the cut responses (all 8 tokens long, the
    budget) are marked untrained and the loss's normaliser holds exactly the others' tokens and count."""
    calls = []

    def recorded(member, seqs, algo, train, rollout, totals=None):
        calls.append((algo.mask_truncated, seqs, totals))
        return policy_update(member, seqs, algo, train, rollout, totals)

    monkeypatch.setattr(update_phase, "policy_update", recorded)
    runs = {}
    for masked in (False, True):
        algo = {"mask_truncated": masked}
        cfg = _config(tiny_zoo, tmp_path / str(masked), algo, max_steps=1, reward="shorter_is_better")
        # one micro-batch: each prompt runs once either way (update_tokens counts the positions the passes ran; cut
        # in two, a group split by the mask's shorter batch would run its prompt twice)
        cfg["train"]["micro_batch_size"] = 16
        run_cohort(config_from_dict(cfg))
        runs[masked] = {r["member"]: r["update_tokens"] for r in metrics(tmp_path / str(masked) / "run")}
    assert all(0 < runs[True][m] < runs[False][m] for m in ("q", "l")), runs
    for masked, seqs, totals in calls:
        kept = [s for s in seqs if s.trained]
        assert totals == (sum(len(s.token_ids) for s in kept), len(kept))
        cut = [s for s in seqs if not s.trained]
        assert (len(cut) > 0) == masked and all(len(s.token_ids) == 8 for s in cut)


def replay(cfg: dict, max_rounds: int) -> list[tuple[list[str], dict]]:
    """Per step, the questions that train and the counts, from the data stream alone: a question is flat for both
    members exactly when it is a yes/no question, so each round refills the yes/no positions with the next
    questions of the stream not yet tried this step."""
    config = config_from_dict(cfg)
    examples, _ = load_training_examples(config.data.train)
    flat = [ex.metadata["question_type"] == "yes/no" for ex in examples]
    sampler = LockstepSampler(len(examples), config.data.batch_size, config.data.seed, config.data.shuffle)
    steps = []
    for _ in range(config.train.max_steps):
        batch = sampler.next_batch()
        tried, rounds, drawn = set(batch), 0, 0
        zero = [p for p, i in enumerate(batch) if flat[i]]
        before = len(zero) / len(batch)
        while zero and rounds < max_rounds:
            fresh = sampler.draw(min(len(zero), sampler.available(tried)), tried)
            for p, i in zip(zero, fresh):
                batch[p] = i
            tried, rounds, drawn = tried | set(fresh), rounds + 1, drawn + len(fresh)
            zero = [p for p, i in enumerate(batch) if flat[i]]
        counts = {"resampled_groups": drawn, "resample_rounds": rounds, "zero_variance_left": len(zero)}
        # each member's share of flat groups, before the rounds and in the batch that trains
        counts.update(zero_variance_frac_before=before, zero_variance_frac=len(zero) / len(batch))
        steps.append(([examples[i].id for i in batch], counts))
    return steps


def test_a_run_trains_on_the_questions_the_data_stream_gives_after_resampling(tiny_zoo, tmp_path):
    """The questions each step trained on (samples.jsonl, in batch order) and the counts in metrics.jsonl are
    those of a replay of the sampler with the yes/no questions refilled: 2 rounds at most."""
    cfg = _config(tiny_zoo, tmp_path, {"resample_zero_variance": True, "resample_max_rounds": 2})
    run_cohort(config_from_dict(cfg))
    expected = replay(cfg, max_rounds=2)
    assert sum(c["resampled_groups"] for _, c in expected) > 0  # the data makes it resample
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    rows = metrics(tmp_path / "run")
    for step, (ids, counts) in enumerate(expected, start=1):
        assert [s["example_id"] for s in samples if s["step"] == step] == ids
        for r in (r for r in rows if r["step"] == step):
            assert {k: r[k] for k in counts} == counts


def test_a_resampling_run_resumes_exactly(tiny_zoo, tmp_path):
    """A 3-step run with a checkpoint at every step; its last checkpoint removed, the resume from step 2 draws the
    same extra questions at step 3 (the sampler's state holds the draws) and ends with the same weights and rows."""
    cfg = _config(tiny_zoo, tmp_path, {"resample_zero_variance": True}, max_steps=3)
    cfg["train"].update(save_every=1, keep_last=3)
    run_cohort(config_from_dict(cfg))
    last = tmp_path / "run" / "checkpoints" / "step-3"
    kept = tmp_path / "step-3"
    shutil.copytree(last, kept)
    rows = metrics(tmp_path / "run")
    assert any(r["step"] == 3 and r["resampled_groups"] > 0 for r in rows)  # step 3 resampled
    shutil.rmtree(last)
    run_cohort(config_from_dict({**cfg, "train": {**cfg["train"], "resume": True}}))
    for mid in ("q", "l"):
        a, b = weights(kept / mid), weights(last / mid)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{mid}: weights differ after resume"
    assert trained_fields(metrics(tmp_path / "run")) == trained_fields(rows)


def test_the_experiment_harness_selects_them_and_its_run_trains(tiny_zoo, tmp_path):
    """`corl experiment-try ... algo.resample_zero_variance=true algo.overlong_penalty=2 ...`: the overrides reach
    every run's config and such a run logs its counts; a window longer than the budget is refused naming it."""
    method = Method(name="gt (labels)", mode="gt", cohort="q", runs=((("q", "qwen2_vl", "original", True),),), seeds=1)
    bases = tiny_zoo["qwen2_vl"].parent  # the experiment's base folder holds one model folder per base
    ours = ["algo.resample_zero_variance=true", "algo.resample_max_rounds=2", "algo.overlong_penalty=2"]
    ours += ["algo.mask_truncated=true"]
    small = ["train.max_steps=1", "data.batch_size=2", "rollout.n=2", "rollout.max_new_tokens=4"]
    (cfg,) = easyvqa_try.try_configs(method, bases, 0, tmp_path, ours + small)
    assert cfg["algo"] == {
        "resample_zero_variance": True,
        "resample_max_rounds": 2,
        "overlong_penalty": 2,
        "mask_truncated": True,
    }
    run_cohort(config_from_dict(cfg))
    (row,) = metrics(Path(cfg["output_dir"]))
    assert math.isfinite(row["loss"]) and 0.0 <= row["truncated_frac"] <= 1.0
    counts = (row["resample_rounds"], row["resampled_groups"], row["zero_variance_left"])
    if row["reward_std"] == 0.0:  # every reward equal (a random member: no right answer, every response cut)
        assert counts == (2, 4, 2)  # both questions flat, replaced twice, still flat
    else:
        assert 0 <= counts[0] <= 2 and counts[1] <= 2 * counts[0] and counts[2] <= 2
    with pytest.raises(ConfigError, match="algo.overlong_penalty: the overlong window"):
        easyvqa_try.try_configs(method, bases, 0, tmp_path, ["algo.overlong_penalty=5", *small])

"""End-to-end training tests of the cohort loop on tiny models and real easy-vqa images.

- every family trains (2 steps, parameters change);
- gold answers never reach a label-free reward (changing them changes no reward and no weight);
- with the `gt` reward, a trivially learnable task is learnt (reward rises from a fixed seed);
- a run killed with SIGKILL and resumed ends with bit-identical weights to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from cohort_helpers import cohort, metrics, shipped_families, trained_fields, weights, write_jsonl

from vlm_corl.config import config_from_dict
from vlm_corl.data.loaders import load_examples
from vlm_corl.training.loop import run_cohort

ROOT = Path(__file__).resolve().parents[1]
TEXT_FAMILIES = set(shipped_families("text"))
FAMILIES = shipped_families()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains(tiny_zoo, tmp_path, family):
    """Two steps with a text-based custom reward (random models give no parseable answers): weights move."""
    data = {"train": {"loader": "easyvqa", "limit": 16}, "batch_size": 2}
    if family in TEXT_FAMILIES:
        rows = [{"id": f"q{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(16)]
        data = {"train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", rows))}, "batch_size": 2}
    cfg = cohort(
        tmp_path,
        [(family, tiny_zoo[family])],
        data=data,
        reward={"mode": "none", "custom": "reward_fixtures:shorter_is_better"},
    )
    summary = run_cohort(config_from_dict(cfg))
    after = weights(Path(summary["checkpoint"]) / family)
    before = weights(tiny_zoo[family])
    assert set(after) == set(before)
    assert any(not torch.equal(after[k], before[k]) for k in before), "no parameter changed"
    assert len(metrics(tmp_path / "run")) == 2


def _easyvqa_rows(n: int, answer_of) -> list[dict]:
    examples = load_examples("easyvqa", split="train", limit=n).examples
    return [{"id": e.id, "question": e.question, "image": e.images[0], "answer": answer_of(e)} for e in examples]


@pytest.mark.parametrize("mode", ["ring", "peers", "soft", "self_vote"])
def test_gold_answers_never_reach_a_label_free_reward(base_models, tmp_path, mode):
    """Same run on the same questions with true vs wrong gold answers: identical rewards and weights in every
    label-free mode (only the diagnostic pseudo-label accuracy differs); under `gt` the weights differ, so the
    comparison can fail."""
    wrong = {"yes": "no", "no": "yes"}
    true_rows = _easyvqa_rows(48, lambda e: e.answer)
    fake_rows = _easyvqa_rows(48, lambda e: wrong.get(e.answer, "circle" if e.answer != "circle" else "red"))
    members = [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]
    if mode == "peers":
        members.append(("qwen_b", base_models["qwen2_vl"]))  # peers needs N >= 3

    def train(reward_mode: str, name: str, rows: list[dict]):
        run = tmp_path / f"{reward_mode}-{name}"
        data = {
            "train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / f"{name}.jsonl", rows))},
            "batch_size": 8,
        }
        cfg = cohort(run, members, data=data, reward={"mode": reward_mode})
        cfg["train"]["max_steps"] = 3
        summary = run_cohort(config_from_dict(cfg))
        return metrics(run / "run"), {m: weights(Path(summary["checkpoint"]) / m) for m, _ in members}

    (rows_true, w_true), (rows_fake, w_fake) = train(mode, "true", true_rows), train(mode, "fake", fake_rows)
    assert any(r["reward_mean"] > 0 for r in rows_true), "label-free rewards were all zero: the test proves nothing"
    for key in ("reward_mean", "reward_std", "agreement", "abstain_rate", "loss", "grad_norm"):
        assert [r[key] for r in rows_true] == [r[key] for r in rows_fake], key
    assert all(torch.equal(w_true[m][k], w_fake[m][k]) for m in w_true for k in w_true[m])
    assert [r["pseudo_label_acc"] for r in rows_true] != [r["pseudo_label_acc"] for r in rows_fake]
    if mode == "ring":
        gt_true, gt_fake = train("gt", "true", true_rows)[1], train("gt", "fake", fake_rows)[1]
        assert any(not torch.equal(gt_true[m][k], gt_fake[m][k]) for m in gt_true for k in gt_true[m])


def test_mixed_cohort_vlm_and_text_model_on_text_questions(tiny_zoo, tmp_path):
    """A vision-language member and a text-only member train together on text questions (no images)."""
    rows = [{"id": f"q{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(16)]
    data = {"train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", rows))}, "batch_size": 2}
    members = [("vlm", tiny_zoo["qwen2_vl"]), ("llm", tiny_zoo["qwen3"])]
    cfg = cohort(tmp_path, members, data=data, reward={"mode": "none", "custom": "reward_fixtures:shorter_is_better"})
    summary = run_cohort(config_from_dict(cfg))
    for mid, path in members:
        after, before = weights(Path(summary["checkpoint"]) / mid), weights(path)
        assert any(not torch.equal(after[k], before[k]) for k in before), mid


def test_kl_epochs_checkpointing_and_eval_hook(base_models, tmp_path):
    """KL to the initial model, two optimizer passes per batch, gradient checkpointing, bf16 autocast, another
    loss aggregation and the eval hook, together: the run trains and writes eval rows."""
    cfg = cohort(
        tmp_path,
        [("qwen", base_models["qwen2_vl"])],
        reward={"mode": "self_vote"},
        algo={"kl_beta": 0.1, "updates_per_batch": 2, "loss_agg": "seq_mean_token_mean"},
        eval={"benchmarks": ["easyvqa"], "every": 2, "limit": 6},
    )
    cfg["train"].update(gradient_checkpointing=True, micro_batch_size=4, mixed_precision="bf16")
    cfg["data"]["batch_size"] = 8
    summary = run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    assert all(r["loss"] is not None and r["grad_norm"] == r["grad_norm"] for r in rows)  # not NaN
    # 2 steps x 2 optimizer passes = 4 updates on one cosine schedule: step 2 starts at update 2 of 4
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 1e-3 * (0.1 + 0.9 * 0.5)])
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["member"], e["n"]) for e in evals] == [(0, "qwen", 6), (2, "qwen", 6)]  # step 0: the base
    assert all(0.0 <= e["accuracy"] <= 1.0 and "accuracy_yes_no" in e for e in evals)
    after, before = weights(Path(summary["checkpoint"]) / "qwen"), weights(base_models["qwen2_vl"])
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_gt_reward_learns_a_trivial_task(base_models, tmp_path):
    """Every question's gold answer is "yes": the warm-started member says yes about half the time at first,
    and GRPO with the gold reward must push its reward up within a few dozen steps."""
    rows = _easyvqa_rows(200, lambda e: "yes")
    data = {"train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / "yes.jsonl", rows))}, "batch_size": 8}
    cfg = cohort(tmp_path, [("qwen", base_models["qwen2_vl"])], data=data, reward={"mode": "gt"})
    cfg["train"].update(max_steps=30, lr=2e-3)
    run_cohort(config_from_dict(cfg))
    rewards = [r["reward_mean"] for r in metrics(tmp_path / "run")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2 and last > 0.8, rewards


def test_resume_after_sigkill_is_bit_identical(base_models, tmp_path):
    """Kill a 6-step run (checkpoints every 2) right after its first checkpoint, resume it, and compare its final
    weights, optimizer and metrics with an uninterrupted run: bit-identical on CPU."""
    members = [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}

    def config(run: Path) -> Path:
        cfg = cohort(run, members, data={"train": {"loader": "easyvqa", "limit": 96}, "batch_size": 8})
        cfg["train"].update(max_steps=6, save_every=2, keep_last=5)
        path = run.with_suffix(".yaml")
        path.write_text(yaml.safe_dump(cfg))
        return path

    def train(cfg_path: Path, *overrides: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "vlm_corl.train", "--config", str(cfg_path), *overrides],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    full, killed = tmp_path / "full", tmp_path / "killed"
    assert train(config(full)).wait(timeout=600) == 0
    proc = train(config(killed))
    deadline = time.time() + 600
    while not (killed / "run" / "checkpoints" / "step-2").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_done = {r["step"] for r in metrics(killed / "run")}
    assert max(steps_done) < 6, "the run finished before it was killed: the test proves nothing"
    resumed = train(config(killed), "train.resume=true")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-3000:]

    for mid, _ in members:
        a = full / "run" / "checkpoints" / "step-6" / mid
        b = killed / "run" / "checkpoints" / "step-6" / mid
        wa, wb = weights(a), weights(b)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"{mid}: weights differ after resume"
        sa, sb = torch.load(a / "trainer_state.pt"), torch.load(b / "trainer_state.pt")
        assert sa["scheduler"] == sb["scheduler"]
        for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values()):
            assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert trained_fields(metrics(full / "run")) == trained_fields(metrics(killed / "run"))


def test_a_run_without_save_last_writes_no_checkpoint(tiny_zoo, tmp_path):
    """train.save_last false with save_every 0: the run keeps its metrics and writes no checkpoint (a sweep's or a
    benchmark's run, where a real member's checkpoint would be tens of GB)."""
    cfg = cohort(tmp_path, [("qwen", tiny_zoo["qwen2_vl"])], reward={"mode": "self_certainty"})
    cfg["train"].update(save_last=False)
    summary = run_cohort(config_from_dict(cfg))
    assert summary["checkpoint"] is None and not list(tmp_path.rglob("step-*"))
    assert [r["step"] for r in metrics(Path(cfg["output_dir"]))] == [1, 2]

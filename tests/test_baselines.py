"""Every baseline reward mode in the same harness (docs/method.md): hand-built checks of their pieces, and a
2-step training run of each on tiny models warm-started on easy-vqa (fixture `base_models` of test_train)."""

import json
from pathlib import Path

import pytest
import torch
from cohort_helpers import cohort, metrics, weights

from vlm_corl.config import MemberConfig, RewardConfig, config_from_dict
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.records import ViewError
from vlm_corl.members.engines import make_engine
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.update import response_token_stats
from vlm_corl.registry import REWARDS
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.rewards.modes import CohortBatch
from vlm_corl.training.run.slots import ema_update, teacher_decay


def test_intrinsic_rewards_read_the_rollout_statistics():
    scores = {"entropy": torch.tensor([[[0.5, 1.5]]]), "self_certainty": torch.tensor([[[2.0, 0.25]]])}
    batch = CohortBatch(("m",), [[["1", "2"]]], [[["a", "b"]]], [[[True, True]]], [None], [None], scores)
    cfg = RewardConfig()
    assert REWARDS.get("entropy").fn(batch, cfg).rewards.tolist() == [[[-0.5, -1.5]]]
    assert REWARDS.get("self_certainty").fn(batch, cfg).rewards.tolist() == [[[2.0, 0.25]]]
    assert REWARDS.get("entropy").needs_scores and not REWARDS.get("ring").needs_scores


def test_teacher_decay_schedule_and_ema():
    assert teacher_decay(0, 101, 0.99, 0.9999) == pytest.approx(0.99)
    assert teacher_decay(100, 101, 0.99, 0.9999) == pytest.approx(0.9999)
    assert teacher_decay(50, 101, 0.99, 0.9999) == pytest.approx((0.99 + 0.9999) / 2)  # cosine midpoint
    teacher, student = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    teacher.weight.data.fill_(1.0)
    student.weight.data.fill_(3.0)
    ema_update(teacher, student.named_parameters(), 0.75)
    assert teacher.weight.item() == pytest.approx(0.75 * 1.0 + 0.25 * 3.0)


def test_scoring_pass_equals_the_rollout_statistics(tiny_zoo):
    """vLLM returns no full distributions, so intrinsic rewards there come from one scoring pass: it must give
    what the HF engine recorded while sampling."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])))
    render = Renderer(member, "original", 10**6, 10**6)
    groups = make_engine("hf", member).generate(
        [render(e) for e in load_examples("easyvqa", split="train", limit=3).examples],
        SamplingParams(n=2, max_new_tokens=6, temperature=0.8, seed=3),
    )
    responses = [r for g in groups for r in g.responses]
    stats = response_token_stats(
        member.model.eval(),
        [g.prompt.inputs for g in groups for _ in g.responses],
        [r.token_ids for r in responses],
        member.policy(0.8),
    )
    for key in ("entropy", "self_certainty"):
        assert torch.allclose(stats[key], torch.tensor([r.mean(key) for r in responses]), atol=1e-4), key


@pytest.mark.parametrize("mode", ["self_certainty", "entropy", "co_rewarding_1", "co_rewarding_2"])
def test_single_model_baselines_train(base_models, tmp_path, mode):
    view = "paraphrase:1" if mode == "co_rewarding_1" else "original"
    cfg = cohort(tmp_path, [("qwen", base_models["qwen2_vl"])], reward={"mode": mode})
    cfg["members"][0]["view"] = view
    cfg["data"]["batch_size"] = 8
    summary = run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    slots = {"co_rewarding_1": ["qwen@original", "qwen@paraphrase:1"], "co_rewarding_2": ["qwen", "qwen.teacher"]}
    assert [r["member"] for r in rows[: len(slots.get(mode, ["qwen"]))]] == slots.get(mode, ["qwen"])
    assert len(rows) == 2 * len(slots.get(mode, ["qwen"]))
    after, before = weights(Path(summary["checkpoint"]) / "qwen"), weights(base_models["qwen2_vl"])
    assert any(not torch.equal(after[k], before[k]) for k in before)
    if mode == "co_rewarding_2":  # the teacher is saved with the cohort and has moved a little toward the student
        teacher = weights(Path(summary["checkpoint"]) / "qwen.teacher")
        moved = [k for k in before if not torch.equal(teacher[k], before[k])]
        assert moved and all(
            (teacher[k] - before[k]).abs().max() <= (after[k] - before[k]).abs().max() + 1e-6 for k in moved
        )
    if mode == "co_rewarding_1":
        assert all(r["abstain_rate"] < 1 for r in rows)  # the two views did produce votes


def test_frozen_peer_votes_but_never_updates(base_models, tmp_path):
    members = [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]
    cfg = cohort(tmp_path, members, reward={"mode": "ring"})
    cfg["members"][1]["trainable"] = False
    cfg["data"]["batch_size"] = 8
    summary = run_cohort(config_from_dict(cfg))
    frozen, before = weights(Path(summary["checkpoint"]) / "llama"), weights(base_models["mllama"])
    assert all(torch.equal(frozen[k], before[k]) for k in before)
    assert not (Path(summary["checkpoint"]) / "llama" / "trainer_state.pt").exists()
    trained = weights(Path(summary["checkpoint"]) / "qwen")
    assert any(not torch.equal(trained[k], v) for k, v in weights(base_models["qwen2_vl"]).items())
    rows = metrics(tmp_path / "run")
    assert all(r["loss"] is None for r in rows if r["member"] == "llama")
    assert any(r["reward_mean"] > 0 for r in rows if r["member"] == "llama")  # it is still rewarded/scored


def test_views_come_from_a_paraphrase_cache_and_gaps_stop_the_run(base_models, tmp_path):
    """data.paraphrases replaces the dataset's wordings by id; a view some example lacks fails before step 1
    under view_fallback=error, and trains on the original wording under view_fallback=original."""
    examples = load_examples("easyvqa", split="train", limit=16).examples
    cache = tmp_path / "para.jsonl"
    cache.write_text(
        "".join(
            json.dumps(
                {
                    "id": e.id,
                    "source_question": e.question,
                    "paraphrases": [f"Look closely. {e.question}"],
                    "rewriter": "hand",
                    "prompt": "-",
                }
            )
            + "\n"
            for e in examples[:12]
        )
    )
    cfg = cohort(
        tmp_path,
        [("qwen", base_models["qwen2_vl"])],
        reward={"mode": "self_vote"},
        data={"train": {"loader": "easyvqa", "limit": 16}, "batch_size": 4, "paraphrases": str(cache)},
    )
    cfg["members"][0]["view"] = "paraphrase:1"
    with pytest.raises(ViewError, match=r"qwen: 4 of 16"):
        run_cohort(config_from_dict(cfg))
    cfg["data"]["view_fallback"] = "original"
    summary = run_cohort(config_from_dict(cfg))
    assert len(metrics(tmp_path / "run")) == 2 and summary["view_fallbacks"]["qwen"] > 0


def test_peers_ema_labels_come_from_the_other_members_teachers():
    # slots: a, a.teacher, b, b.teacher, c, c.teacher; the teachers vote y, x, y; the students' own votes are s
    answers = [[[v] * 2] for v in ("s", "y", "s", "x", "s", "y")]
    batch = CohortBatch(("a", "a.t", "b", "b.t", "c", "c.t"), answers, [[["t"] * 2]] * 6, [[[True] * 2]] * 6, [None],
                        [None])  # fmt: skip
    out = REWARDS.get("peers_ema").fn(batch, RewardConfig())
    # a: b's and c's teachers vote x and y: a tie abstains; b: a's y and c's y -> y; c: a's y and b's x tie
    assert out.labels == [[None], [None], ["y"], [None], [None], [None]]
    assert out.rewards[2].tolist() == [[0.0, 0.0]] and REWARDS.get("peers_ema").layout == "ema_teacher"
    batch = CohortBatch(("a", "a.t", "b", "b.t"), answers[:4], [[["t"] * 2]] * 4, [[[True] * 2]] * 4, [None], [None])
    out = REWARDS.get("peers_ema").fn(batch, RewardConfig())
    assert out.labels == [["x"], [None], ["y"], [None]]  # a pair: each member learns from the other's teacher
    assert out.rewards[0].tolist() == [[0.0, 0.0]] and out.rewards[2].tolist() == [[0.0, 0.0]]
    batch.answers[0][0][:] = ["x", "z"]
    assert REWARDS.get("peers_ema").fn(batch, RewardConfig()).rewards[0].tolist() == [[1.0, 0.0]]


def test_peers_ema_trains_members_with_their_teachers(base_models, tmp_path):
    members = [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]
    cfg = cohort(tmp_path, members, reward={"mode": "peers_ema"})
    summary = run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    assert [r["member"] for r in rows[:4]] == ["qwen", "qwen.teacher", "llama", "llama.teacher"]
    assert all(r["abstain_rate"] == 1.0 for r in rows if r["member"].endswith(".teacher"))  # teachers never train
    checkpoint = Path(summary["checkpoint"])
    for mid, base in (("qwen", "qwen2_vl"), ("llama", "mllama")):
        before, teacher = weights(base_models[base]), weights(checkpoint / f"{mid}.teacher")
        assert any(not torch.equal(teacher[k], before[k]) for k in before)  # each teacher followed its student

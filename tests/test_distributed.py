"""Scale-out pieces in one process: placement, shards, the exchange by batch position, the sampler's batches,
the whole-batch loss normaliser, and fp32 master weights for a member saved in bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cohort_helpers import cohort, metrics, weights, write_jsonl

from vlm_corl.config import ConfigError, MemberConfig, config_from_dict
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.distributed.exchange import LockstepError, exchange
from vlm_corl.distributed.world import PlacementError, World, describe, place_members, shard, sum_over
from vlm_corl.members.member import load_member
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.phases.update_phase import batch_totals
from vlm_corl.training.run.setup import _check_shards


def _members(*ids, ranks=None):
    return [MemberConfig(id=i, model="m", ranks=ranks[n] if ranks else None) for n, i in enumerate(ids)]


def test_automatic_placement_splits_ranks_evenly():
    assert place_members(_members("a", "b"), 1) == {"a": (0,), "b": (0,)}
    assert place_members(_members("a", "b"), 2) == {"a": (0,), "b": (1,)}
    assert place_members(_members("a", "b"), 4) == {"a": (0, 1), "b": (2, 3)}
    assert place_members(_members("a", "b", "c", "d"), 2) == {"a": (0,), "b": (0,), "c": (1,), "d": (1,)}
    assert describe({"a": (0, 1), "b": (2,)}) == "rank 0: a; rank 1: a; rank 2: b"


def test_explicit_placement_hosts_members_in_turn_or_apart():
    members = _members("policy", "frozen", "other", ranks=[[0, 1], [1, 0], [2]])
    assert place_members(members, 3) == {"policy": (0, 1), "frozen": (0, 1), "other": (2,)}


@pytest.mark.parametrize(
    "ids, ranks, world, message",
    [
        (("a", "b", "c"), None, 2, "3 members (a, b, c) cannot be split evenly over 2 processes"),
        (("a", "b"), [[0, 1], [1, 2]], 3, "overlapping but different ranks"),
        (("a", "b"), [[0], [5]], 2, "member 'b' is placed on ranks [5] but the launch has 2 process(es)"),
        (("a", "b"), [[0], [1]], 3, "ranks [2] host no member"),
        (("a", "b"), [[0], None], 2, "set for some members but not all"),
    ],
)
def test_placement_errors_name_the_members_and_the_fix(ids, ranks, world, message):
    with pytest.raises(
        PlacementError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        place_members(_members(*ids, ranks=ranks), world)


def test_shards_cover_the_batch_once():
    for batch, ranks in ((8, (0, 1)), (7, (2, 3, 4)), (3, (0, 1, 2))):
        parts = [list(shard(batch, ranks, r)) for r in ranks]
        assert sum(parts, []) == list(range(batch))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_exchange_lines_rows_up_by_batch_position_even_for_a_repeated_example():
    world = World()
    local = {"a": {1: (["x1"],), 0: (["x0"],)}, "b": {0: (["y0"],), 1: (["y1"],)}}
    (answers,) = exchange(world, ["q7", "q7"], local, ["b", "a"])
    assert answers == [[["y0"], ["y1"]], [["x0"], ["x1"]]]
    with pytest.raises(LockstepError, match=r"slot 'a' has no answers for batch positions \[1\]"):
        exchange(world, ["q1", "q2"], {"a": {0: (["x"],)}, "b": {0: (["y"],), 1: (["z"],)}}, ["a", "b"])


def test_sampler_batches_never_repeat_an_example_across_an_epoch_boundary():
    sampler = LockstepSampler(10, 4, seed=3)
    seen = []
    for _ in range(12):
        batch = sampler.next_batch()
        assert len(batch) == len(set(batch)) == 4
        seen.append(batch)
    assert sampler.epoch == 5  # two batches per epoch of 10, the last 2 of each permutation dropped
    assert len({i for b in seen for i in b}) == 10  # reshuffled epochs reach every example
    with pytest.raises(ConfigError, match="data.batch_size=11 is larger than the 10 training examples"):
        LockstepSampler(10, 11, seed=0)


def test_batch_totals_count_what_the_member_trains_on():
    lengths = [[[3, 1], [2, 2]], [[5, 5], [1, 0]]]  # 2 slots of one member, (B=2, K=2)
    rewards = [torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.0, 0.0], [0.0, 1.0]])]
    assert batch_totals(lengths, rewards, filter_zero_variance=False) == (19, 8)
    assert batch_totals(lengths, rewards, filter_zero_variance=True) == (5, 4)  # only groups with variance


def test_sum_over_a_one_rank_group_changes_nothing():
    t = torch.arange(4.0)
    sum_over(None, [t])
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_member_saved_in_bf16_learns_at_lr_1e6(tiny_zoo, tmp_path):
    """bf16 weights updated in bf16 at lr 1e-6 would round every change away; the member trains fp32 master
    weights (and may compute in bf16), so one step changes them."""
    bf16 = tmp_path / "bf16"
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    member.model.to(torch.bfloat16)
    member.save(bf16)
    loaded = load_member(MemberConfig(id="q", model=str(bf16)))
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    frozen = load_member(MemberConfig(id="q", model=str(bf16), trainable=False))
    assert all(p.dtype == torch.bfloat16 for p in frozen.model.parameters())  # peers may stay in bf16

    cfg = cohort(tmp_path, [("q", bf16)], reward={"mode": "none", "custom": "reward_fixtures:shorter_is_better"})
    cfg["train"].update(max_steps=1, lr=1e-6, mixed_precision="bf16")
    summary = run_cohort(config_from_dict(cfg))
    before, after = weights(bf16), weights(Path(summary["checkpoint"]) / "q")
    changed = [k for k in before if not torch.equal(after[k], before[k].float())]
    assert len(changed) > len(before) // 2, f"only {len(changed)} of {len(before)} tensors changed"


def test_fp16_training_is_refused_with_the_fix(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])])
    cfg["members"][0]["dtype"] = "float16"
    with pytest.raises(ConfigError, match=r"members\[0\].dtype.*use bfloat16"):
        config_from_dict(cfg)
    cfg["members"][0]["trainable"] = False
    cfg["members"].append({"id": "p", "model": str(tiny_zoo["mllama"])})
    config_from_dict(cfg)  # a frozen peer may load in fp16


def test_a_member_with_more_ranks_than_examples_per_step_is_a_config_error(tiny_zoo, tmp_path):
    cfg = cohort(
        tmp_path,
        [("q", tiny_zoo["qwen2_vl"])],
        data={"train": {"loader": "easyvqa", "limit": 8}, "batch_size": 2},
        reward={"mode": "self_vote"},
    )
    with pytest.raises(ConfigError, match="data.batch_size=2 is smaller than the 3 ranks of a member"):
        _check_shards(config_from_dict(cfg), {"q": (0, 1, 2)})
    _check_shards(config_from_dict(cfg), {"q": (0, 1)})


def test_a_run_directory_holds_one_run(tiny_zoo, tmp_path, caplog):
    """Re-running into a used output_dir is refused (appending metrics and pruning checkpoints would mix two
    runs); train.overwrite clears it; resuming past max_steps is an error; a torn metrics row is dropped."""
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"})
    cfg["train"]["max_steps"] = 2
    run_cohort(config_from_dict(cfg))
    with pytest.raises(
        ConfigError,
        match=r"already holds a run \(metrics.jsonl, samples.jsonl, summary.json, config.yaml, "
        r"checkpoints, plan.json\): continue it with train.resume=true",
    ):
        run_cohort(config_from_dict(cfg))
    with pytest.raises(ConfigError, match="train.max_steps=2 but .* is already at step 2"):
        run_cohort(config_from_dict({**cfg, "train": {**cfg["train"], "resume": True}}))
    (tmp_path / "run" / "metrics.jsonl").open("a").write('{"step": 3, "memb')  # a process died mid-write
    run_cohort(config_from_dict({**cfg, "train": {**cfg["train"], "resume": True, "max_steps": 3}}))
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    assert "dropping a torn or unreadable row" in caplog.text
    summary = run_cohort(config_from_dict({**cfg, "train": {**cfg["train"], "overwrite": True, "max_steps": 1}}))
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]
    assert summary["checkpoint"].endswith("step-1") and not (tmp_path / "run" / "checkpoints" / "step-3").exists()


def test_a_torn_last_row_is_restored_from_the_checkpoint(tiny_zoo, tmp_path):
    """A kill mid-write can leave member a's row of the checkpoint's step whole and b's torn: the resume puts
    b's row back from the checkpoint (it used to restore rows only when no row of that step survived)."""
    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])], reward={"mode": "ring"})
    cfg["train"].update(max_steps=2, save_every=2)
    run_cohort(config_from_dict(cfg))
    path = tmp_path / "run" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    whole = {(json.loads(x)["step"], json.loads(x)["member"]): json.loads(x) for x in lines}
    torn = [x for x in lines if (json.loads(x)["step"], json.loads(x)["member"]) != (2, "b")]
    path.write_text("\n".join(torn) + "\n" + lines[-1][: len(lines[-1]) // 2])  # b's step-2 row torn
    run_cohort(config_from_dict({**cfg, "train": {**cfg["train"], "resume": True, "max_steps": 3}}))
    rows = metrics(tmp_path / "run")
    assert sorted((r["step"], r["member"]) for r in rows) == [(s, m) for s in (1, 2, 3) for m in ("a", "b")]
    restored = next(r for r in rows if (r["step"], r["member"]) == (2, "b"))
    timed = ("time_", "rollout_tokens_per_s", "update_tokens_per_s", "update_mfu", "gpu_busy_")  # with the times
    assert restored == {k: v for k, v in whole[(2, "b")].items() if not k.startswith(timed)}  # timed after


def test_summary_records_dropped_records_and_the_environment(tiny_zoo, tmp_path):
    rows = [{"id": f"q{i}", "question": f"What is {i}?", "answer": str(i)} for i in range(6)] + [{"question": "no id?"}]
    rows += [{"id": "broken", "answer": "1"}]  # no question
    data = {"train": {"loader": "jsonl", "path": str(write_jsonl(tmp_path / "q.jsonl", rows))}, "batch_size": 2}
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen3"])], data=data, reward={"mode": "self_vote"})
    cfg["train"]["max_steps"] = 1
    run_cohort(config_from_dict(cfg))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["kept"] == 7 and sum(summary["data"]["skipped"].values()) == 1
    env = summary["environment"]
    assert env["torch_threads"] == torch.get_num_threads() and env["processes"] == 1
    assert {"torch", "transformers"} <= env["versions"].keys()


@pytest.mark.parametrize("filtered", [False, True])
def test_a_step_with_nothing_to_learn_still_steps_the_schedule(tiny_zoo, tmp_path, filtered):
    """All-zero advantages and all groups filtered out (algo.filter_zero_variance) behave the same: a
    zero-gradient optimizer step, so the learning-rate schedule advances identically."""
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "none", "custom": "reward_fixtures:constant"})
    cfg["train"].update(max_steps=3, warmup_ratio=0.0, lr=1e-3)
    cfg["algo"] = {"filter_zero_variance": filtered}
    run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    assert [r["grad_norm"] for r in rows] == [0.0, 0.0, 0.0]
    assert rows[0]["lr"] == 1e-3 and rows[0]["lr"] > rows[1]["lr"] > rows[2]["lr"]  # cosine decay went on


def test_resume_falls_back_past_a_checkpoint_missing_a_members_weights(tiny_zoo, tmp_path, caplog):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward={"mode": "ring"})
    cfg["train"].update(max_steps=4, save_every=2, keep_last=5)
    run_cohort(config_from_dict(cfg))
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step-4" / "l" / "model.safetensors").unlink()  # e.g. a disk that filled up on another node
    resumed = {**cfg, "train": {**cfg["train"], "resume": True, "max_steps": 5}}
    run_cohort(config_from_dict(resumed))
    assert "step-4 is incomplete" in caplog.text
    assert [r["step"] for r in metrics(tmp_path / "run") if r["member"] == "q"] == [1, 2, 3, 4, 5]
    assert (ckpts / "step-5" / "l" / "model.safetensors").exists()

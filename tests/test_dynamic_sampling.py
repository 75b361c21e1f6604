"""DAPO's dynamic sampling (algo.resample_zero_variance) and overlong shaping (algo.overlong_penalty), the pure
pieces against numbers worked by hand: which questions are zero-variance in a cohort, the length penalty, the
sampler's extra draws (and their resume), and the replacement bookkeeping over ranks and rounds. Their wiring into
the loop, and runs with each option: tests/test_dynamic_sampling_runs.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from cohort_helpers import on_ranks

from vlm_corl.config.schema import MemberConfig
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.distributed.world import shard
from vlm_corl.registry import REWARDS
from vlm_corl.training.phases.reward_phase import trained_slots
from vlm_corl.training.rewards.dynamic_sampling import StepRollouts, merge, resample, sub_shards
from vlm_corl.training.rewards.modes import RewardOutput, add_overlong_penalty, cohort_zero_variance, overlong_penalty
from vlm_corl.training.run.slots import slot_specs

# ---- which questions no trained member learns from ------------------------------------------------------


def test_a_question_is_zero_variance_only_when_every_trained_slot_has_equal_rewards():
    """Slots a, b trained, c a frozen peer; 4 questions, K = 2. q0: a [1, 1] and b [0, 0] both flat (c varies,
    but a frozen peer never decides): replaced. q1: a varies: kept. q2: b varies: kept. q3: a and b flat: replaced.
    With a alone trained, q2 (a flat there) is replaced too; with nothing trained, nothing is."""
    rewards = torch.tensor(
        [
            [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]],  # a
            [[0.0, 0.0], [1.0, 1.0], [1.0, 0.0], [0.5, 0.5]],  # b
            [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]],  # c (frozen)
        ]
    )
    assert cohort_zero_variance(rewards, [True, True, False]).tolist() == [True, False, False, True]
    assert cohort_zero_variance(rewards, [True, False, False]).tolist() == [True, False, True, True]
    assert cohort_zero_variance(rewards, [False, False, False]).tolist() == [False] * 4


def test_under_ema_teachers_only_the_students_decide():
    """peers_ema: the slots are a, a.teacher, b, b.teacher (their layout from the reward registry), and the run's
    trained slots are the students alone. On q0 both students are flat while both teachers vary: no trained model
    learns from q0, so it is replaced (counting the teachers would keep it); on q1 student b varies: kept. A frozen
    member's slots never decide either."""
    members = [MemberConfig(id="a", model="m"), MemberConfig(id="b", model="m")]
    specs = slot_specs(members, REWARDS.get("peers_ema").layout)
    run = SimpleNamespace(cfg=SimpleNamespace(members=members), specs=specs)
    assert [s.id for s in specs] == ["a", "a.teacher", "b", "b.teacher"]
    assert trained_slots(run) == [True, False, True, False]
    rewards = torch.tensor(
        [
            [[1.0, 1.0], [0.0, 0.0]],  # a
            [[0.0, 1.0], [1.0, 0.0]],  # a.teacher
            [[0.0, 0.0], [0.0, 1.0]],  # b
            [[1.0, 0.0], [0.0, 1.0]],  # b.teacher
        ]
    )
    assert cohort_zero_variance(rewards, trained_slots(run)).tolist() == [True, False]
    members[1].trainable = False  # b frozen: its slots never decide, a alone is flat on both questions
    assert trained_slots(run) == [True, False, False, False]
    assert cohort_zero_variance(rewards, trained_slots(run)).tolist() == [True, True]


# ---- the overlong penalty -------------------------------------------------------------------------------


def test_the_overlong_penalty_falls_linearly_over_the_last_tokens_of_the_budget():
    """L_max 8, L_cache 4: free up to 8 - 4 = 4 tokens; 5 -> (4 - 5) / 4 = -0.25, 7 -> -0.75, 8 (cut at the
    budget) -> -1, beyond -> -1. L_cache = L_max: every token costs 1/8. DAPO's own setting (L_max 20480,
    L_cache 4096): 18432 tokens -> -0.5."""
    lengths = torch.tensor([0, 4, 5, 7, 8, 9])
    assert overlong_penalty(lengths, 8, 4).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert overlong_penalty(torch.tensor([0, 2, 8]), 8, 8).tolist() == [0.0, -0.25, -1.0]
    assert overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096).tolist() == [0.0, -0.5, -1.0]
    for cache in (0, 9):
        with pytest.raises(ValueError, match="the overlong window must be 1..8 tokens"):
            overlong_penalty(lengths, 8, cache)


def test_the_penalty_is_added_with_its_factor_and_logged_as_a_part():
    """Rewards [1, 0] of lengths [6, 8] (L_max 8, L_cache 4): penalties -0.5 and -1, factor 0.5: [0.75, -0.5];
    the unweighted penalty is the part "overlong", the mode's parts and labels are kept."""
    scored = RewardOutput(torch.tensor([[[1.0, 0.0]]]), {"agreement": torch.tensor([[[1.0, 0.0]]])}, [["red"]])
    shaped = add_overlong_penalty(scored, torch.tensor([[[6, 8]]]), 8, 4, factor=0.5)
    assert shaped.rewards.tolist() == [[[0.75, -0.5]]]
    assert shaped.parts["overlong"].tolist() == [[[-0.5, -1.0]]]
    assert shaped.parts["agreement"].tolist() == [[[1.0, 0.0]]] and shaped.labels == [["red"]]


# ---- the replacements: sampler, positions, rounds -------------------------------------------------------


def test_the_sampler_draws_extra_questions_from_its_stream_and_resumes_after_them():
    """10 examples in index order, batches of 3: [0, 1, 2], then 2 extra questions [3, 4], so the next batch is
    [5, 6, 7]; 3 extra ones avoiding 0 from position 8 find only 8, 9 in this epoch, so they come from the next:
    [1, 2, 3]. A sampler restored from the state after the draws continues identically."""
    sampler = LockstepSampler(10, 3, seed=0, shuffle=False)
    first = sampler.next_batch()
    assert (first, sampler.draw(2, set(first))) == ([0, 1, 2], [3, 4])
    assert sampler.available({0, 1, 2, 3, 4}) == 5
    assert sampler.next_batch() == [5, 6, 7]
    assert sampler.draw(3, {0}) == [1, 2, 3] and sampler.epoch == 1
    restored = LockstepSampler(10, 3, seed=0, shuffle=False)
    restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert [restored.next_batch(), restored.draw(1, set())] == [sampler.next_batch(), sampler.draw(1, set())]
    sampler.excluded = {9}
    assert sampler.available({0, 1}) == 7


def test_each_member_gets_the_replacements_of_its_own_shard():
    """Shards a: positions 0-1, b: 2-3; replacements for positions [1, 2, 3]: a rolls out j = 0 (position 1),
    b j = 1, 2; for [0, 1] b has none."""
    shards = {"a": range(0, 2), "b": range(2, 4)}
    assert sub_shards(shards, [1, 2, 3]) == {"a": range(0, 1), "b": range(1, 3)}
    assert sub_shards(shards, [0, 1]) == {"a": range(0, 2), "b": range(2, 2)}


def _scored(rows: list) -> RewardOutput:
    """RewardOutput of per-slot (B, K) rewards, the reward itself as its one part, labels "L<slot><question>"."""
    rewards = torch.tensor(rows, dtype=torch.float32)
    labels = [[f"L{n}{b}" for b in range(rewards.shape[1])] for n in range(rewards.shape[0])]
    return RewardOutput(rewards, {"r": rewards.clone()}, labels)


def test_two_ranks_merge_each_replacement_into_the_shard_that_rolled_it_out():
    """A batch of 4 (examples 10-13) over two ranks of member a (positions 0-1 and 2-3); positions 1 and 2 are
    replaced by examples 20, 21: rank 0 rolled out 20 (j = 0), rank 1 21 (j = 1). Each rank keeps its own
    groups, now g10 g20 and g21 g13; the exchanged fields, rewards, parts and labels agree on both ranks."""

    def on_rank(world):
        mine = shard(4, (0, 1), world.rank)
        step = StepRollouts(
            [10, 11, 12, 13],
            ["e10", "e11", "e12", "e13"],
            [[f"g{10 + p}" for p in mine]],
            [[[["x10"], ["x11"], ["x12"], ["x13"]]]],
            _scored([[[1, 1], [0, 0], [0, 0], [1, 0]]]),
            {"a": 1.0},
        )
        sub = sub_shards({"a": mine}, [1, 2])
        fresh = StepRollouts(
            [20, 21],
            ["e20", "e21"],
            [[f"g{20 + j}" for j in sub["a"]]],
            [[[["x20"], ["x21"]]]],
            _scored([[[0, 1], [1, 0]]]),
            {"a": 0.5},
        )
        out = merge(step, fresh, [1, 2], {"a": mine}, ["a"])
        return (
            out.groups,
            (out.indices, out.batch, out.exchanged, out.scored.rewards.tolist(), out.rollout_s),
            (
                out.scored.parts["r"].tolist(),
                out.scored.labels,
            ),
        )

    first, second = on_ranks(2, on_rank)
    assert first[0] == [["g10", "g20"]] and second[0] == [["g21", "g13"]]
    assert first[1:] == second[1:]
    indices, batch, exchanged, rewards, seconds = first[1]
    assert indices == [10, 20, 21, 13] and batch == ["e10", "e20", "e21", "e13"]
    assert exchanged == [[[["x10"], ["x20"], ["x21"], ["x13"]]]]
    assert rewards == [[[1, 1], [0, 1], [1, 0], [1, 0]]] and first[2][0] == rewards
    assert first[2][1] == [["L00", "L00", "L01", "L03"]] and seconds == {"a": 1.5}


class Stream:
    """A fake round of rollouts for `resample`: question i's rewards are `table[i]`, one (K,) row per slot; fresh
    questions come from `order`, never one of `avoid` (each call recorded)."""

    def __init__(self, table: dict, order: list[int]):
        self.table, self.order, self.calls = table, order, []

    def step(self, indices: list[int]) -> StepRollouts:
        rewards = [[self.table[i][n] for i in indices] for n in range(2)]
        return StepRollouts(
            list(indices),
            [f"e{i}" for i in indices],
            [[f"g{i}" for i in indices] for _ in range(2)],
            [[[[i] for i in indices] for _ in range(2)]],
            _scored(rewards),
            {"s0": 1.0, "s1": 1.0},
        )

    def __call__(self, positions: list[int], round_: int, avoid: set[int]) -> StepRollouts | None:
        self.calls.append((list(positions), round_, set(avoid)))
        fresh = [i for i in self.order if i not in avoid][: len(positions)]
        return self.step(fresh) if fresh else None


def _resample(stream: Stream, start: list[int], max_rounds: int):
    step = stream.step(start)
    return resample(step, [True, True], max_rounds, stream, {"m": range(4)}, ["m", "m"])


# two trained slots (two views of one member), K = 2; flat: equal rewards for both slots, so zero-variance
FLAT, VARIED = [[1.0, 1.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 1.0]]
TABLE = {10: FLAT, 11: VARIED, 12: FLAT, 13: VARIED, 20: FLAT, 21: VARIED, 30: FLAT, 31: VARIED}


def test_zero_variance_questions_are_replaced_round_by_round_up_to_the_bound():
    """Questions 10-13: 10 and 12 are flat for both slots. Round 1 refills positions [0, 2] with 20 (flat) and 21
    (varied); round 2 refills [0] with 30 (flat again). The bound of 2 rounds stops there: 3 questions drawn,
    one left; a third round gets 31 and leaves none. Each round avoids every question of the step so far."""
    stream = Stream(TABLE, [20, 21, 30, 31])
    out, counts = _resample(stream, [10, 11, 12, 13], max_rounds=2)
    assert counts == {"resampled_groups": 3, "resample_rounds": 2, "zero_variance_left": 1}
    assert out.indices == [30, 11, 21, 13] and out.groups[1] == ["g30", "g11", "g21", "g13"]
    assert out.scored.rewards[:, 2].tolist() == [[1.0, 1.0], [0.0, 1.0]]  # 21's rewards at 12's place
    assert stream.calls == [([0, 2], 1, {10, 11, 12, 13}), ([0], 2, {10, 11, 12, 13, 20, 21})]
    out, counts = _resample(Stream(TABLE, [20, 21, 30, 31]), [10, 11, 12, 13], max_rounds=3)
    assert counts == {"resampled_groups": 4, "resample_rounds": 3, "zero_variance_left": 0}
    assert out.indices == [31, 11, 21, 13] and out.rollout_s == {"s0": 4.0, "s1": 4.0}


def test_resampling_stops_when_the_data_runs_out_and_does_nothing_without_zero_variance():
    """Only 20 (flat) is left to draw: round 1 refills position 0 of [0, 2] (fewer questions than positions),
    round 2 finds nothing (no round counted). A batch without a flat question draws nothing."""
    stream = Stream(TABLE, [20])
    out, counts = _resample(stream, [10, 11, 12, 13], max_rounds=5)
    assert counts == {"resampled_groups": 1, "resample_rounds": 1, "zero_variance_left": 2}
    assert out.indices == [20, 11, 12, 13] and len(stream.calls) == 2
    quiet = Stream(TABLE, [20])
    assert _resample(quiet, [11, 13], max_rounds=3)[1] == {
        "resampled_groups": 0,
        "resample_rounds": 0,
        "zero_variance_left": 0,
    }
    assert quiet.calls == []

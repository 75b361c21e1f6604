"""The lockstep pieces every step relies on: the data order (`LockstepSampler`), the exchange of answers between
ranks (`exchange`), and the paired reward of co_rewarding_1/2 (`rewards.paired_reward`), with numbers by hand."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from vlm_corl.config import RewardConfig
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.distributed.exchange import LockstepError, exchange
from vlm_corl.distributed.world import World
from vlm_corl.registry import REWARDS
from vlm_corl.training.rewards.modes import CohortBatch, paired_reward


def draw(sampler: LockstepSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def epochs(num_examples: int, batch_size: int, seed: int, count: int, shuffle: bool = True) -> list[list[int]]:
    """The indices each of `count` epochs hands out, in order (one list per epoch, its batches concatenated)."""
    sampler = LockstepSampler(num_examples, batch_size, seed, shuffle)
    per_epoch = num_examples // batch_size
    out = []
    for e in range(count):
        batches = draw(sampler, per_epoch)
        assert sampler.epoch == e
        assert all(len(set(b)) == len(b) == batch_size for b in batches)  # no duplicate inside a batch
        out.append([i for b in batches for i in b])
    return out


# ---- the sampler ----------------------------------------------------------------------------------------


def test_every_epoch_is_a_permutation_and_the_tail_is_dropped():
    """10 examples, batches of 3: 3 batches (9 distinct indices) per epoch; the 10th index of the epoch is
    dropped and the 4th batch starts the next epoch. With 12 and batches of 4 every epoch is all of 0..11."""
    for order in epochs(10, 3, seed=7, count=6):
        assert len(order) == len(set(order)) == 9 and set(order) <= set(range(10))
    dropped = [set(range(10)) - set(order) for order in epochs(10, 3, seed=7, count=6)]
    assert all(len(d) == 1 for d in dropped) and len(set.union(*dropped)) > 1  # not always the same example
    for order in epochs(12, 4, seed=7, count=4):
        assert sorted(order) == list(range(12))


def test_epochs_and_seeds_give_different_orders_and_the_same_seed_the_same():
    a, b, c = (epochs(12, 4, seed=s, count=3) for s in (7, 7, 8))
    assert a == b
    assert a != c
    assert len({tuple(o) for o in a}) == 3  # each epoch is a fresh permutation


def test_shuffle_false_is_index_order_with_the_tail_dropped():
    sampler = LockstepSampler(10, 3, seed=5, shuffle=False)
    assert draw(sampler, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]  # 9 is dropped, epoch 1 restarts
    assert sampler.epoch == 1


@pytest.mark.parametrize("taken", [2, 3, 4])  # mid-epoch, at the epoch's end (next call rolls over), after it
def test_a_restored_sampler_continues_with_the_same_batches(taken):
    """A checkpoint's sampler state (JSON in the cohort state) resumes the exact sequence of the uninterrupted
    run: 10 examples in batches of 3, stopped after `taken` batches, then 7 more batches."""
    run = LockstepSampler(10, 3, seed=11)
    draw(run, taken)
    state = json.loads(json.dumps(run.state_dict()))
    resumed = LockstepSampler(10, 3, seed=11)
    resumed.load_state_dict(state)
    assert draw(resumed, 7) == draw(run, 7)
    with pytest.raises(ValueError, match="taken on 10 training examples, the data now has 12"):
        LockstepSampler(12, 3, seed=11).load_state_dict(state)


def test_peek_batch_returns_the_next_batch_without_advancing():
    """Also at the epoch's end (after 3 batches of 3 out of 10), where the next batch starts epoch 1."""
    sampler, twin = LockstepSampler(10, 3, seed=2), LockstepSampler(10, 3, seed=2)
    for _ in range(5):
        state = sampler.state_dict()
        peeked = [sampler.peek_batch(), sampler.peek_batch()]
        assert sampler.state_dict() == state
        assert peeked == [twin.next_batch()] * 2 == [sampler.next_batch()] * 2


# ---- the exchange ---------------------------------------------------------------------------------------


@dataclass
class Launch(World):
    """This rank in a launch whose other ranks' exchange parts are given (dependency injection for all_gather):
    all_gather returns every rank's part in rank order, this rank's own at `rank`."""

    others: tuple = ()

    def all_gather(self, obj) -> list:
        parts = list(self.others)
        parts.insert(self.rank, obj)
        return parts


def rows(slot: str, positions) -> dict[int, tuple]:
    """(answers, lengths) rows of K=2 responses whose values name their slot and batch position."""
    return {p: ([f"{slot}{p}.0", f"{slot}{p}.1"], [p, 10 + p]) for p in positions}


def expected(slots, positions=range(3)):
    answers = [[[f"{s}{p}.0", f"{s}{p}.1"] for p in positions] for s in slots]
    lengths = [[[p, 10 + p] for p in positions] for _ in slots]
    return [answers, lengths]


def test_exchange_orders_rows_by_the_given_slots_and_batch_positions():
    """The local dict is built in another order (slot b first, positions descending): the result is in the
    given slot order (a, c, b) x positions 0, 1, 2, one nested list per field."""
    local = {"b": rows("b", [2, 1, 0]), "c": rows("c", [1, 2, 0]), "a": rows("a", [0, 2, 1])}
    assert exchange(World(), ["q0", "q1", "q2"], local, ["a", "c", "b"]) == expected(["a", "c", "b"])


def test_exchange_merges_the_ranks_parts():
    """Rank 0 rolled out positions 0-1 of slot a, rank 1 position 2 of slot a and all of slot b."""
    ids = ["q0", "q1", "q2"]
    other = {"batch": ids, "rows": {"a": rows("a", [2]), "b": rows("b", [0, 1, 2])}}
    world = Launch(rank=0, size=2, others=(other,))
    assert exchange(world, ids, {"a": rows("a", [0, 1])}, ["a", "b"]) == expected(["a", "b"])


@pytest.mark.parametrize(
    "theirs, difference",
    [
        (["q0", "q9", "q2"], "position 1: 'q9' vs 'q1'"),
        (["q0", "q1"], "2 vs 3 examples"),
    ],
)
def test_a_rank_with_other_examples_breaks_the_lockstep(theirs, difference):
    ids = ["q0", "q1", "q2"]
    other = {"batch": theirs, "rows": {"b": rows("b", range(3))}}
    with pytest.raises(LockstepError, match=rf"rank 1 drew other examples than rank 0 .*{difference}"):
        exchange(Launch(rank=0, size=2, others=(other,)), ids, {"a": rows("a", range(3))}, ["a", "b"])
    # the same from rank 1's side: rank 0's part (at index 0) differs
    mine = {"batch": ids, "rows": {"a": rows("a", range(3))}}
    with pytest.raises(LockstepError, match="rank 0 drew other examples than rank 1"):
        exchange(Launch(rank=1, size=2, others=(mine,)), theirs, {"b": rows("b", range(3))}, ["a", "b"])


@pytest.mark.parametrize(
    "local, message",
    [
        ({"a": rows("a", [0, 2]), "b": rows("b", range(3))}, r"slot 'a' has no answers for batch positions \[1\]"),
        ({"a": rows("a", range(3)), "b": rows("b", range(4))}, r"slot 'b' .*\(unexpected: \[3\]\)"),
        ({"a": rows("a", range(3))}, r"slot 'b' has no answers for batch positions \[0, 1, 2\]"),
    ],
)
def test_missing_or_unexpected_positions_are_an_error(local, message):
    with pytest.raises(LockstepError, match=message):
        exchange(World(), ["q0", "q1", "q2"], local, ["a", "b"])


# ---- paired_reward --------------------------------------------------------------------------------------


def cohort_batch(answers, format_ok=None) -> CohortBatch:
    n, b, k = len(answers), len(answers[0]), len(answers[0][0])
    return CohortBatch(
        member_ids=tuple(f"s{i}" for i in range(n)),
        answers=answers,
        texts=[[[str(a) for a in g] for g in s] for s in answers],
        format_ok=format_ok or [[[True] * k for _ in range(b)] for _ in range(n)],
        choices=[None] * b,
        gold=[None] * b,
    )


def test_paired_reward_labels_a_member_by_its_teacher_and_the_teacher_by_the_member():
    """co_rewarding_2 layout: slot 0 the member, slot 1 its EMA teacher; B=2 examples, K=4; vote_threshold 0.5,
    format_weight 0.5.
    Votes: member ex0 ["0.5", "0.5", "3", None] -> "0.5"; ex1 ["circle", "square", "square", "circle"] -> a 2-2
    tie, the first seen, "circle" (share 2/4 = 0.5 reaches the threshold).
    Teacher ex0 ["3", "3", "\\frac{1}{2}", "3"] -> "3"; ex1 [None, None, None, "red"] -> share 1/4 < 0.5: abstains.
    Labels (the partner's vote): member [3, None], teacher [0.5, circle].
    Rewards = match + 0.5 * format, 0 for a group without a label:
      member ex0 vs "3": match [0, 0, 1, 0], format [1, 0, 1, 1] -> [0.5, 0, 1.5, 0.5]; ex1 unlabelled -> 0s.
      teacher ex0 vs "0.5": "\\frac{1}{2}" is equivalent -> match [0, 0, 1, 0], format 1s -> [0.5, 0.5, 1.5, 0.5];
      teacher ex1 vs "circle": no match, format [0, 0, 0, 1] -> [0, 0, 0, 0.5]."""
    answers = [
        [["0.5", "0.5", "3", None], ["circle", "square", "square", "circle"]],
        [["3", "3", "\\frac{1}{2}", "3"], [None, None, None, "red"]],
    ]
    fmt = [[[True, False, True, True], [True] * 4], [[True] * 4, [False, False, False, True]]]
    cfg = RewardConfig(mode="co_rewarding_2", vote_threshold=0.5, format_weight=0.5)
    out = REWARDS.get("co_rewarding_2").fn(cohort_batch(answers, fmt), cfg)
    assert out.labels == [["3", None], ["0.5", "circle"]]
    assert out.rewards.tolist() == [[[0.5, 0.0, 1.5, 0.5], [0.0] * 4], [[0.5, 0.5, 1.5, 0.5], [0.0, 0.0, 0.0, 0.5]]]
    assert out.parts["agreement"].tolist() == [[[0, 0, 1, 0], [0] * 4], [[0, 0, 1, 0], [0] * 4]]


def test_paired_reward_pairs_slots_2k_and_2k_plus_1():
    """co_rewarding_1 layout with two members: slots (a original, a paraphrase, b original, b paraphrase), one
    example, K=3. Votes 1, 2, 3, 4 (each slot's plurality); each slot is labelled by its partner in the pair
    (0<->1, 2<->3): labels 2, 1, 4, 3, and each slot's odd third response is its partner's vote -> [0, 0, 1].
    (A ring would label slot 0 by slot 3's vote 4, slot 2 by slot 1's 2: no reward at all.)"""
    answers = [[["1", "1", "2"]], [["2", "2", "1"]], [["3", "3", "4"]], [["4", "4", "3"]]]
    out = paired_reward(cohort_batch(answers), RewardConfig(mode="co_rewarding_1"))
    assert out.labels == [["2"], ["1"], ["4"], ["3"]]
    assert torch.equal(out.rewards, torch.tensor([[[0.0, 0.0, 1.0]]] * 4))
    specs = {mode: REWARDS.get(mode) for mode in ("co_rewarding_1", "co_rewarding_2")}
    assert all(s.fn is paired_reward and not s.uses_gold for s in specs.values())
    assert (specs["co_rewarding_1"].layout, specs["co_rewarding_2"].layout) == ("two_views", "ema_teacher")


def test_a_rank_sending_a_slot_the_cohort_lacks_breaks_the_lockstep():
    """A rank on another config (a member the others do not have) is a LockstepError naming the slot, not a
    bare KeyError."""
    with pytest.raises(LockstepError, match="slot 'zz', which is not one of the cohort's"):
        exchange(World(), ["q0"], {"a": {0: (["x"],)}, "zz": {0: (["y"],)}}, ["a"])

"""Label headroom (vlm_corl.training.rewards.headroom): by-hand cases of every topology, the algebra (self_vote 0, ring
sums to 0), the vote threshold reaching the labels, the confidence prediction, and the ranking of candidate cohorts."""

import random

import pytest

from vlm_corl.config.schema import RewardConfig
from vlm_corl.training.rewards.headroom import (
    cohort_headroom,
    cohort_labels,
    cohort_report,
    headroom_term,
    rank_cohorts,
    reachable_term,
    self_consistency,
    settled,
    settled_answer,
    vote_pairs,
)


def records(rows, gold, types=None):
    """One member's sampled records: rows[j] = its K answers to question j."""
    types = types or ["color"] * len(rows)
    return [
        {"id": f"q{j}", "type": t, "preds": list(answers), "gold": g}
        for j, (answers, g, t) in enumerate(zip(rows, gold, types))
    ]


def test_headroom_term_by_hand():
    assert headroom_term("red", "blue", "red") == 1  # the label teaches
    assert headroom_term("blue", "red", "red") == -1  # the label misleads
    assert headroom_term("red", "red", "red") == 0
    assert headroom_term("blue", "green", "red") == 0  # both wrong: nothing to gain or lose
    assert headroom_term(None, "blue", "red") == 0  # an abstaining label neither teaches nor misleads
    assert headroom_term("red", None, "red") == 1  # an abstaining vote is not right


def test_peers_by_hand():
    gold = ["red", "red"]
    cohort = {
        "A": records([["red"] * 4, ["blue"] * 4], gold),
        "B": records([["red"] * 4, ["blue"] * 4], gold),
        "C": records([["blue"] * 4, ["red"] * 4], gold),
    }
    lab = cohort_labels(cohort, "peers")
    # question 0: C's peers (A, B) both say red: C learns; A's and B's peers split 1-1: their labels abstain
    assert [lab["labels"][i][0] for i in range(3)] == [None, None, "red"]
    # question 1: C is right and its peers agree on blue: C is misled
    assert [lab["labels"][i][1] for i in range(3)] == [None, None, "blue"]
    h = cohort_headroom(lab)
    assert h["members"]["C"]["headroom"]["all"]["mean"] == 0.0  # +1 then -1
    assert h["members"]["A"]["headroom"]["all"]["mean"] == 0.0
    assert h["members"]["A"]["abstain"] == 1.0 and h["members"]["C"]["abstain"] == 0.0
    # only question 0: C gains, so the cohort's mean is +1/3
    one = {k: v[:1] for k, v in cohort.items()}
    assert cohort_headroom(cohort_labels(one, "peers"))["headroom"]["all"]["mean"] == pytest.approx(1 / 3)


def test_gt_headroom_is_the_share_of_wrong_votes():
    gold = ["red", "red", "blue", "blue"]
    cohort = {
        "A": records([["red"] * 2, ["blue"] * 2, ["blue"] * 2, ["red", "red"]], gold),
        "B": records([["red"] * 2, ["red"] * 2, ["red"] * 2, ["blue"] * 2], gold),
    }
    h = cohort_headroom(cohort_labels(cohort, "gt"))
    assert h["members"]["A"]["headroom"]["all"]["mean"] == 0.5
    assert h["members"]["B"]["headroom"]["all"]["mean"] == 0.25


def random_cohort(n, questions, k, rng):
    answers = ["red", "blue", "green"]
    gold = [rng.choice(answers) for _ in range(questions)]
    types = [rng.choice(["color", "shape"]) for _ in range(questions)]
    return {f"m{i}": records([[rng.choice(answers) for _ in range(k)] for _ in gold], gold, types) for i in range(n)}


@pytest.mark.parametrize("n", [2, 3, 5])
def test_self_vote_is_zero_and_a_ring_sums_to_zero(n):
    rng = random.Random(n)
    cohort = random_cohort(n, 60, 4, rng)
    report = cohort_report(cohort, ("self_vote", "ring", "peers"))
    assert report["modes"]["self_vote"]["headroom"]["all"]["mean"] == 0.0
    for t in report["modes"]["self_vote"]["headroom"]["by_type"].values():
        assert t["mean"] == 0.0 and t["ci"] == 0.0
    # every answer parses, so no vote abstains: one member's gain is another's loss, question by question
    assert report["modes"]["ring"]["headroom"]["all"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert report["modes"]["ring"]["headroom"]["all"]["ci"] == pytest.approx(0.0, abs=1e-12)
    if n == 2:  # of two, each one's peers are the other: peers is the ring
        assert report["modes"]["peers"]["headroom"] == report["modes"]["ring"]["headroom"]


def test_the_vote_threshold_reaches_the_labels():
    gold = ["red"]
    split = records([["red", "red", "blue", "green"]], gold)  # a vote of 2 of 4
    sure = records([["blue"] * 4], gold)
    cohort = {"A": sure, "B": split}
    loose = cohort_labels(cohort, "ring")
    strict = cohort_labels(cohort, "ring", RewardConfig(mode="ring", vote_threshold=0.75))
    assert loose["labels"][0] == ["red"]  # A is labelled by B's vote
    assert strict["labels"][0] == [None]  # B's vote does not reach 3 of 4: A's label abstains
    assert strict["labels"][1] == ["blue"]
    assert cohort_headroom(strict)["members"]["A"]["headroom"]["all"]["mean"] == 0.0
    assert cohort_headroom(loose)["members"]["A"]["headroom"]["all"]["mean"] == 1.0


def test_settled_answer_and_the_confidence_prediction():
    assert self_consistency(["red", "red", "blue", None], "red") == 0.5
    assert self_consistency(["red"], None) == 0.0
    assert settled_answer(["red", "blue"], [1.0, 0.5]) == "red"
    assert settled_answer(["red", "blue", "blue"], [0.5, 0.5, 0.5]) == "blue"  # the top members' plurality
    assert settled_answer(["red", "blue"], [0.75, 0.75]) is None  # a split at the top abstains
    assert settled_answer([None, None], [0.0, 0.0]) is None
    gold = ["red", "blue"]
    cohort = {
        "sure": records([["red"] * 4, ["red"] * 4], gold),  # always sure, right then wrong
        "unsure": records([["blue", "blue", "red", "green"], ["blue", "blue", "blue", "red"]], gold),
    }
    s = settled(cohort_labels(cohort, "peers"))
    # q0: the sure member's red (right); q1: the sure member's red (1.0 > 0.75; wrong)
    assert s["accuracy"]["all"]["mean"] == 0.5
    # q0 teaches "unsure" (+1, its vote blue is wrong); q1 misleads it (-1, its vote blue is right); "sure" 0
    assert s["headroom"]["all"]["mean"] == 0.0
    assert s["abstain"] == 0.0


def test_intervals_and_types():
    rng = random.Random(0)
    cohort = random_cohort(3, 80, 4, rng)
    h = cohort_headroom(cohort_labels(cohort, "peers"))["headroom"]
    assert h["all"]["n"] == 80 and h["all"]["ci"] > 0
    assert set(h["by_type"]) == {"color", "shape"}
    assert sum(t["n"] for t in h["by_type"].values()) == 80


def test_rank_cohorts_best_first_and_bad_records():
    gold = ["red"] * 6
    right, wrong = records([["red"] * 4] * 6, gold), records([["blue"] * 4] * 6, gold)
    other_wrong = records([["green"] * 4] * 6, gold)
    recs = {"r1": right, "r2": right, "w": wrong, "w2": other_wrong}
    cohorts = {"teaches w": ["r1", "r2", "w"], "misleads": ["w", "w2", "r1"]}
    ranked = rank_cohorts({name: {m: recs[m] for m in ms} for name, ms in cohorts.items()})
    assert [r["cohort"] for r in ranked] == ["teaches w", "misleads"]
    assert ranked[0]["modes"]["peers"]["headroom"]["all"]["mean"] == pytest.approx(1 / 3)
    assert ranked[0]["rank"] == 1 and ranked[1]["rank"] == 2
    # equal headroom; only one's learner has a sample that earns the right label: it ranks first by default
    mixed = records([["blue", "blue", "blue", "red"]] * 6, gold)
    recs |= {"m": mixed}
    pair = {"constant learner": ["r1", "r2", "w"], "learner that can reach it": ["r1", "r2", "m"]}
    cohorts = {n: {m: recs[m] for m in ms} for n, ms in pair.items()}
    ranked = rank_cohorts(cohorts)
    assert [r["cohort"] for r in ranked] == ["learner that can reach it", "constant learner"]
    assert [r["modes"]["peers"]["reachable"]["all"]["mean"] for r in ranked] == pytest.approx([1 / 3, 0.0])
    by_headroom = rank_cohorts(cohorts, by="headroom")  # a tie there: kept in the given order
    assert [r["cohort"] for r in by_headroom] == ["constant learner", "learner that can reach it"]
    with pytest.raises(ValueError, match="different questions"):
        cohort_labels({"a": right, "b": right[:3]}, "peers")
    with pytest.raises(ValueError, match="no sampled answers"):
        cohort_labels({"a": right, "b": [{k: v for k, v in r.items() if k != "preds"} for r in right]}, "peers")
    with pytest.raises(ValueError, match="does not label members"):
        cohort_labels({"a": right, "b": right}, "entropy")


def test_reachable_headroom_needs_a_sample_that_earns_the_label():
    assert reachable_term("red", "blue", "red", ["blue", "red", "blue", "blue"]) == 1  # one sample earns reward
    assert reachable_term("red", "blue", "red", ["blue"] * 4) == 0  # no variance in the group: no gradient
    assert reachable_term("blue", "red", "red", ["red", "red", "blue", "red"]) == -1  # reachable, misleading
    assert reachable_term(None, "blue", "red", ["red"] * 4) == 0
    gold = ["red", "red"]
    cohort = {  # a member with one constant answer is right-labelled on both questions but can move on neither
        "constant": records([["blue"] * 4, ["blue"] * 4], gold),
        "a": records([["red"] * 4, ["red"] * 4], gold),
        "b": records([["red"] * 4, ["red", "blue", "red", "red"]], gold),
    }
    h = cohort_headroom(cohort_labels(cohort, "peers"))
    assert h["members"]["constant"]["headroom"]["all"]["mean"] == 1.0
    assert h["members"]["constant"]["reachable"]["all"]["mean"] == 0.0
    assert h["headroom"]["all"]["mean"] == pytest.approx(1 / 3) and h["reachable"]["all"]["mean"] == 0.0


# ---- the references each figure compares with (issue 32, item 9) ---------------------------------------------------

# math-verify's verify(gold, pred) is not symmetric: "1<x<2" as gold takes "(1,2)", not the reverse.
GOLD, ITS_INTERVAL = "1<x<2", "(1,2)"


def test_each_term_reads_its_reference_first():
    """Pins the order of the comparisons in `headroom_term` (gold first), `reachable_term` (the label, which a
    sample must earn), `self_consistency` (the vote) and the votes' accuracy in `vote_pairs` and
    `member_headroom` (gold first); the bug: the two sides swapped, which no symmetric answer shows."""
    assert headroom_term(ITS_INTERVAL, "3", GOLD) == 1  # the label is right, the vote wrong
    assert headroom_term("3", ITS_INTERVAL, GOLD) == -1
    assert reachable_term(GOLD, "3", GOLD, [ITS_INTERVAL, "3"]) == 1  # a sample earns the label
    assert self_consistency([ITS_INTERVAL, "3"], GOLD) == 0.5
    cohort = {"a": records([[ITS_INTERVAL] * 2], [GOLD]), "b": records([["3"] * 2], [GOLD])}
    lab = cohort_labels(cohort, "ring")
    assert cohort_headroom(lab)["members"]["a"]["vote_accuracy"]["all"]["mean"] == 1.0
    assert vote_pairs(lab)["acc_sum"] == 1.0


def test_reachable_headroom_needs_a_sample_that_earns_the_label_not_gold():
    """A member whose samples all say red (gold) under a wrong label blue: no sample earns the label, so the label
    cannot mislead it (0), though its samples match gold. Pins `reachable_term` (the bug: samples compared with
    gold, which gives -1)."""
    assert headroom_term("blue", "red", "red") == -1
    assert reachable_term("blue", "red", "red", ["red"] * 4) == 0


def test_a_members_headroom_is_its_labels_gain_over_its_vote():
    """One question, gold red. Ring of three: a votes red, b blue, c red, so a's label is c's red (a right
    already: 0), b's is a's red (b wrong: +1), c's is b's blue (c misled: -1). The confidence prediction: a (sure,
    red) settles the question on red: b gains, a and c keep theirs: 1/3. Peers with c voting blue too: a's label is
    b's and c's blue (a misled: -1), b's and c's peers tie (abstain: 0): -1/3. Pins `member_headroom`,
    `cohort_headroom` and `settled` (the bug: label and vote swapped into `headroom_term`: +1/3 and -1/3 there)."""
    gold = ["red"]
    cohort = {
        "a": records([["red"] * 4], gold),
        "b": records([["blue", "blue", "blue", "red"]], gold),
        "c": records([["red", "red", "red", "blue"]], gold),
    }
    h = cohort_headroom(cohort_labels(cohort, "ring"))
    assert [h["members"][m]["headroom"]["all"]["mean"] for m in "abc"] == [0.0, 1.0, -1.0]
    s = settled(cohort_labels(cohort, "ring"))
    assert s["headroom"]["all"]["mean"] == pytest.approx(1 / 3) and s["accuracy"]["all"]["mean"] == 1.0
    cohort["c"] = records([["blue"] * 4], gold)
    peers = cohort_labels(cohort, "peers")
    assert [row[0] for row in peers["labels"]] == ["blue", None, None]
    assert cohort_headroom(peers)["headroom"]["all"]["mean"] == pytest.approx(-1 / 3)

"""Collapse diagnostics: answer entropy (group and batch), unanimity, the collapse detector on hand-built
histories, and one real 2-step cohort run whose rows and summary carry them (issue 5, item 2)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from cohort_helpers import cohort, metrics

from vlm_corl.config import config_from_dict
from vlm_corl.training.monitor.collapse import (
    CollapseRule,
    CollapseTracker,
    collapse_evidence,
    collapse_warnings,
    flag_step,
    window_size,
)
from vlm_corl.training.monitor.metrics import (
    answer_entropy,
    answer_key,
    batch_entropy,
    cohort_unanimity,
    entropy,
    group_entropy,
    member_metrics,
    unanimity,
    unanimous_questions,
)
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput

H_31 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))  # entropy of (3/4, 1/4)
H_21 = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
NEW_KEYS = ("answer_entropy", "answer_entropy_batch", "unanimous_rate", "unanimous_wrong_rate", "collapse_flag")


def _batch(answers, choices=None):
    n, b, k = len(answers), len(answers[0]), len(answers[0][0])
    return CohortBatch(
        tuple(f"m{i}" for i in range(n)),
        answers,
        [[[str(a) for a in g] for g in m] for m in answers],
        [[[True] * k for _ in range(b)] for _ in range(n)],
        choices or [None] * b,
        [None] * b,
    )


# ---- entropy and unanimity by hand ----------------------------------------------------------------------


def test_entropy_by_hand():
    assert entropy([4]) == 0.0 and entropy([]) == 0.0 and entropy([0, 0]) == 0.0
    assert entropy([1, 1]) == pytest.approx(math.log(2))
    assert entropy([3, 1, 0]) == pytest.approx(H_31)


def test_group_entropy_over_equivalence_classes_without_unparseable():
    assert group_entropy(["yes", "Yes", "yes.", "no"]) == pytest.approx(H_31)  # "Yes", "yes." = "yes"
    assert group_entropy(["0.5", "\\frac{1}{2}", "3", None]) == pytest.approx(H_21)  # None excluded
    assert group_entropy(["red"] * 4) == 0.0
    assert group_entropy([None, None]) is None
    # mean over groups with a parseable answer: the all-None group is skipped, not counted as 0
    groups = [["yes", "yes", "yes", "no"], [None] * 4, ["a", "b", "a", "b"]]
    assert answer_entropy(groups, [None] * 3) == pytest.approx((H_31 + math.log(2)) / 2)
    assert answer_entropy([[None]], [None]) is None
    # multiple choice: a letter and the choice's text are one class
    assert group_entropy(["A", "cat", "(A)", "dog"], ("cat", "dog")) == pytest.approx(H_31)


def test_batch_entropy_across_questions():
    assert batch_entropy([["red", "Red"], ["red.", "blue"]], [None, None]) == pytest.approx(H_31)
    # a cohort answering everything with one constant word has batch entropy 0, however many questions
    assert batch_entropy([["yes"] * 4 for _ in range(8)], [None] * 8) == 0.0
    assert batch_entropy([["yes", "no"], ["circle", "red"]], [None, None]) == pytest.approx(math.log(4))
    assert batch_entropy([[None, "no"], [None, None]], [None, None]) == 0.0
    assert batch_entropy([[None]], [None]) is None
    assert answer_key("cat", ("cat", "dog")) == "(A)" == answer_key("A.", ("cat", "dog"))
    assert answer_key("Cat.", None) == "cat"


def test_unanimity_abstentions_and_wrong_consensus():
    votes = [["yes", "red", "yes", "circle"], ["yes", "Red", None, "square"]]
    gold = ["no", "red", "yes", "circle"]
    out = unanimity(unanimous_questions(votes, [None] * 4, gold))
    assert out == {"unanimous_rate": 0.5, "unanimous_wrong_rate": 0.25}  # q0 unanimous+wrong, q1 right; q2 abstains
    assert unanimity(unanimous_questions(votes, [None] * 4, [None] * 4)) == {
        "unanimous_rate": 0.5,
        "unanimous_wrong_rate": None,
    }
    # the denominator of the wrong rate is the questions WITH gold
    assert unanimity(unanimous_questions(votes, [None] * 4, ["no", None, None, None]))["unanimous_wrong_rate"] == 1.0
    # a single slot: unanimous exactly where it votes
    assert unanimity(unanimous_questions([["a", None]], [None, None], [None, None]))["unanimous_rate"] == 0.5


def test_cohort_metrics_use_the_votes_and_their_threshold():
    answers = [
        [["yes", "yes", "no", "yes"], ["red", "blue", "green", "red"]],
        [["yes", "no", "yes", "yes"], ["red", "red", "red", "red"]],
    ]
    b = _batch(answers)
    assert unanimity(cohort_unanimity(b, ["no", "red"], 0.0)) == {"unanimous_rate": 1.0, "unanimous_wrong_rate": 0.5}
    # tau = 0.6: member 0 abstains on q1 (share 2/4), so q1 is no longer unanimous
    assert unanimity(cohort_unanimity(b, ["no", "red"], 0.6)) == {"unanimous_rate": 0.5, "unanimous_wrong_rate": 0.5}


def test_member_metrics_rows_carry_the_diversity_keys():
    answers = [[["yes", "yes", "no", None], ["red", "red", "red", "red"]]]
    b = _batch(answers)
    out = RewardOutput(torch.zeros(1, 2, 4), {}, [["yes", "red"]])
    row = member_metrics(0, b, out, [[3, 3, 3, 3], [2, 2, 2, 2]], ["no", "red"])
    assert row["answer_entropy"] == pytest.approx(H_21 / 2)
    assert row["answer_entropy_batch"] == pytest.approx(
        -(2 / 7 * math.log(2 / 7) + 1 / 7 * math.log(1 / 7) + 4 / 7 * math.log(4 / 7))
    )
    assert row["distinct_answers"] == 1.5 and row["pseudo_label_acc"] == 0.5


def test_member_metrics_compare_each_diagnostic_with_its_own_reference():
    """Three questions, K = 2. q0: label red, gold blue, answers red red; q1: no label, gold x, answers x y;
    q2: label "(1,2)", gold "1<x<2" (which math-verify, gold first, equates with "(1,2)"), answers "(1,2)" twice.
    agreement (answers vs the label, labelled questions only) = 4/4; answer_acc (answers vs gold) = 3/6;
    pseudo_label_acc (label vs gold) = 1/2; the cohort's unanimous vote "(1,2)" on q2 is not wrong. Pins
    `metrics.member_metrics` and `unanimous_questions` (the bugs: agreement against gold, answer accuracy against
    the label, gold read second)."""
    answers = [[["red", "red"], ["x", "y"], ["(1,2)", "(1,2)"]]]
    out = RewardOutput(torch.zeros(1, 3, 2), {}, [["red", None, "(1,2)"]])
    gold = ["blue", "x", "1<x<2"]
    row = member_metrics(0, _batch(answers), out, [[1, 1]] * 3, gold)
    assert (row["agreement"], row["answer_acc"], row["pseudo_label_acc"]) == (1.0, 0.5, 0.5)
    assert unanimous_questions([["(1,2)"]], [None], ["1<x<2"]) == [(True, False)]


# ---- the detector on hand-built histories -------------------------------------------------------------


def _lerp(a, b, t):
    return a + (b - a) * t


def history(steps, slots, *, entropy=(2.0, 2.0), agreement=(0.4, 0.4), unanimous=(0.2, 0.2), pla=(0.6, 0.6)):
    rows = []
    for s in range(1, steps + 1):
        t = (s - 1) / (steps - 1)
        for slot in slots:
            row = {
                "step": s,
                "member": slot,
                "answer_entropy_batch": _lerp(*entropy, t),
                "agreement": _lerp(*agreement, t),
                "unanimous_rate": _lerp(*unanimous, t),
            }
            if pla is not None:
                row["pseudo_label_acc"] = _lerp(*pla, t)
            rows.append(row)
    return rows


def test_window_rule():
    assert window_size(9) is None and window_size(10) == 5 and window_size(30) == 6 and window_size(100) == 20
    assert window_size(1000) == 50
    assert window_size(4, CollapseRule(min_window=2)) == 2


def test_collapsing_history_is_flagged_once_per_slot_with_evidence():
    rows = history(30, ["a", "b"], entropy=(2.0, 0.1), agreement=(0.4, 0.95), unanimous=(0.2, 0.9), pla=(0.6, 0.3))
    warnings = collapse_warnings(rows)
    assert [w["slot"] for w in warnings] == ["a", "b"]
    w = warnings[0]
    assert w["step"] >= 10 and w["uses_pseudo_label_acc"] is True
    assert w["answer_entropy_batch_early"] > w["answer_entropy_batch_late"]
    assert w["agreement_late"] > w["agreement_early"] and w["pseudo_label_acc_late"] < w["pseudo_label_acc_early"]
    assert w["early_steps"][0] == 1 and w["late_steps"][1] == w["step"]
    json.dumps(warnings)  # goes to summary.json
    assert collapse_evidence([r for r in rows if r["member"] == "a"])["flagged"]


def test_healthy_histories_are_not_flagged():
    # diversity steady while agreement rises and pseudo-labels improve
    assert collapse_warnings(history(40, ["a", "b"], entropy=(2.0, 1.9), agreement=(0.4, 0.9), pla=(0.5, 0.8))) == []
    # sharpening (diversity falls, agreement rises) while pseudo-label accuracy RISES: learning, not collapse
    assert collapse_warnings(history(40, ["a"], entropy=(2.0, 0.8), agreement=(0.4, 0.9), pla=(0.5, 0.8))) == []
    # diversity falls but agreement does not rise
    assert (
        collapse_warnings(
            history(40, ["a"], entropy=(2.0, 0.1), agreement=(0.6, 0.6), unanimous=(0.5, 0.5), pla=(0.6, 0.3))
        )
        == []
    )
    # too short to judge: 9 steps
    assert collapse_warnings(history(9, ["a"], entropy=(2.0, 0.0), agreement=(0.0, 1.0), pla=(1.0, 0.0))) == []


def test_without_gold_diversity_and_agreement_suffice():
    rows = history(30, ["a"], entropy=(2.0, 0.1), agreement=(0.4, 0.95), pla=None)
    (w,) = collapse_warnings(rows)
    assert w["uses_pseudo_label_acc"] is False and w["pseudo_label_acc_early"] is None
    # unanimity rising alone counts as agreement rising
    rows = history(30, ["a"], entropy=(2.0, 0.1), agreement=(0.5, 0.5), unanimous=(0.1, 0.8), pla=None)
    assert len(collapse_warnings(rows)) == 1


def test_flag_step_marks_rows_and_logs_once(caplog):
    rows = history(30, ["a", "b"], entropy=(2.0, 0.1), agreement=(0.4, 0.95), pla=(0.6, 0.3))
    rows = [r for r in rows if r["member"] == "a"] + [r for r in rows if r["member"] == "b" and r["step"] <= 5]
    rows.sort(key=lambda r: r["step"])
    seen: list[dict] = []
    with caplog.at_level(logging.WARNING, logger="vlm_corl"):
        for step in range(1, 31):
            new = [r for r in rows if r["step"] == step]
            flag_step(seen, new)
            seen.extend(new)
    logged = [r for r in caplog.records if "possible collapse" in r.getMessage()]
    assert len(logged) == 1 and " a " in logged[0].getMessage()
    flags = [r["collapse_flag"] for r in seen if r["member"] == "a"]
    assert flags[:9] == [None] * 9 and 1 in flags and flags[-1] == 1
    first = next(r["step"] for r in seen if r["member"] == "a" and r["collapse_flag"] == 1)
    assert collapse_warnings(seen)[0]["step"] == first  # summary and log agree
    assert all(r["collapse_flag"] is None for r in seen if r["member"] == "b")  # 5 steps: not evaluated


def test_the_trackers_bounded_rows_read_like_the_whole_history():
    """A run keeps only each slot's first and last max_window rows (`collapse._Ends`): past 250 steps both windows
    are 50 rows, so dropping the wrong rows (the newest instead of the oldest, one row too few) would change the
    windows' means. A slot steady for 240 steps then collapsing: the tracker, fed row by row, flags the step and
    evidence `collapse_warnings` finds on the whole history, and reads every held row as the list would."""
    steady = {"answer_entropy_batch": 2.0, "agreement": 0.4, "unanimous_rate": 0.2, "pseudo_label_acc": 0.6}
    fallen = {"answer_entropy_batch": 0.2, "agreement": 0.95, "unanimous_rate": 0.9, "pseudo_label_acc": 0.3}
    rows = [{"step": s, "member": "m", **(steady if s <= 240 else fallen)} for s in range(1, 301)]
    (expected,) = collapse_warnings(rows)
    assert expected["step"] > 250 and expected["early_steps"] == [1, 50]  # both windows at their 50 rows
    tracker = CollapseTracker()
    for row in rows:
        tracker.flag([dict(row)])
    assert tracker.warnings() == [expected]
    ends = tracker.ends["m"]
    assert ends.n == 300 and [ends[i]["step"] for i in [*range(50), *range(250, 300)]] == [
        *range(1, 51),
        *range(251, 301),
    ]


# ---- a real run -----------------------------------------------------------------------------------------


def test_real_run_logs_collapse_diagnostics(base_models, tmp_path):
    from vlm_corl.reporting.markdown import render_report
    from vlm_corl.training.loop import run_cohort

    members = [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]
    summary = run_cohort(config_from_dict(cohort(tmp_path, members, reward={"mode": "ring"})))
    rows = metrics(tmp_path / "run")
    assert len(rows) == 4
    for row in rows:
        assert set(NEW_KEYS) <= set(row), set(NEW_KEYS) - set(row)
        assert 0.0 <= row["unanimous_rate"] <= 1.0 and row["collapse_flag"] is None  # 2 steps: too few to judge
        assert row["unanimous_wrong_rate"] is not None  # easy-vqa has gold (diagnostic only)
    for step in (1, 2):
        assert len({r["unanimous_rate"] for r in rows if r["step"] == step}) == 1  # cohort-level
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["collapse_warnings"] == summary["collapse_warnings"] == []
    report = render_report(tmp_path / "run")
    assert report.exists() and (tmp_path / "run" / "diversity.png").exists()

"""Collapse inside a category: per-category step sums by hand, their running windows, the category rules on
hand-built histories (the reproduction's shape: one category slides onto one answer while the batch, mostly
yes/no questions with improving pseudo-labels, looks healthy), the eval-drop flag, and the guard's rollback."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vlm_corl.training.monitor.category_metrics import category_step_stats, pooled_diversity, window_metrics
from vlm_corl.training.monitor.collapse import collapse_warnings, eval_drops, flag_step, window_size
from vlm_corl.training.monitor.metrics import unanimous_questions
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput
from vlm_corl.training.run.checkpoint import list_checkpoints
from vlm_corl.training.run.guard import roll_back, stop_message


def test_category_step_sums_by_hand():
    # slot 0 of 2 on three questions (two colour, one yes/no), K = 2
    answers = [[["red", "red"], ["blue", None], ["yes", "no"]], [["red", "red"], ["green", "green"], ["yes", "yes"]]]
    batch = CohortBatch(("a", "b"), answers, [[["t"] * 2] * 3] * 2, [[[True] * 2] * 3] * 2, [None] * 3, [None] * 3)
    labels = [["red", "green", "yes"], ["red", "blue", "yes"]]
    out = RewardOutput(
        torch.tensor([[[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]], [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]]), {}, labels
    )
    gold = ["red", "blue", None]
    votes = [["red", "blue", "yes"], ["red", "green", "yes"]]
    flags = unanimous_questions(votes, [None] * 3, gold)
    assert flags == [(True, False), (False, False), (True, None)]
    stats = category_step_stats(0, batch, out, ["color", "color", "yes/no"], gold, flags)
    color = stats["color"]
    assert color["questions"] == 2
    assert color["reward"] == [2.0, 4] and color["agreement"] == [2.0, 4]  # "red" x2 match; "blue"/None don't
    assert color["answer_entropy"] == [0.0, 2] and color["distinct_answers"] == [2.0, 2]
    assert color["unanimous"] == [1.0, 2] and color["unanimous_wrong"] == [0.0, 2]
    assert color["pseudo_label_acc"] == [1.0, 2]  # red = red; green != blue
    assert color["answer_acc"] == [3.0, 4]  # red, red, blue right; None wrong
    assert color["answers"] == {"red": 2, "blue": 1}
    yes_no = stats["yes/no"]
    assert yes_no["answer_entropy"] == [pytest.approx(math.log(2)), 1] and yes_no["answer_acc"] == [0.0, 0]
    # windows add sums and counts over steps; pooled answers give the category's spread
    window = window_metrics([stats, stats])
    assert window["category/color/agreement"] == 0.5 and window["category/yes_no/pseudo_label_acc"] is None
    assert window["category/color/distinct_pooled"] == 2 and window["category/color/questions"] == 4
    assert window["category/color/answer_entropy_pooled"] == pytest.approx(
        -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    )
    assert pooled_diversity({"a": 3, "<other>": 2}) == (
        pytest.approx(-(0.6 * math.log(0.6) + 2 * 0.2 * math.log(0.2))),
        3,
    )


def test_category_sums_read_the_label_and_gold_first():
    """math-verify's verify(gold, pred) is not symmetric: "1<x<2" as the reference takes "(1,2)", not the reverse.
    q0: label "1<x<2", gold 5, answers "(1,2)" and 3; q1: label "(1,2)", gold "1<x<2", answers "(1,2)" twice.
    agreement 3/4 (one on q0, two on q1), answer accuracy 2/4 (q1), pseudo-label accuracy 1/2 (q1). Pins
    `category_step_stats` (the bug: the response, or the label, read first against its reference)."""
    answers = [[["(1,2)", "3"], ["(1,2)", "(1,2)"]]]
    batch = CohortBatch(("a",), answers, [[["t"] * 2] * 2], [[[True] * 2] * 2], [None] * 2, [None] * 2)
    out = RewardOutput(torch.zeros(1, 2, 2), {}, [["1<x<2", "(1,2)"]])
    stats = category_step_stats(0, batch, out, ["c", "c"], ["5", "1<x<2"], [(False, False)] * 2)["c"]
    assert (stats["agreement"], stats["answer_acc"], stats["pseudo_label_acc"]) == ([3.0, 4], [2.0, 4], [1.0, 2])


def _cat(answers: dict, agree: tuple, pla: tuple, questions: int = 2) -> dict:
    zero = [0.0, 0]
    return {
        "questions": questions,
        "reward": list(agree),
        "agreement": list(agree),
        "answer_entropy": zero,
        "distinct_answers": zero,
        "unanimous": [float(questions), questions],
        "unanimous_wrong": zero,
        "pseudo_label_acc": list(pla),
        "answer_acc": zero,
        "answers": answers,
    }


def reproduction(steps: int = 40, colour_collapses: bool = True) -> list[dict]:
    """Slot "b": the batch looks healthy (diversity steady, agreement and pseudo-label accuracy rising); its
    colour questions (2 of 16 per step, K = 4) go from diverse answers onto the peer's constant "blue" at
    agreement 1.0 from step 15 on, their pseudo-labels wrong throughout (the peer is at chance on colour)."""
    rows = []
    for s in range(1, steps + 1):
        t = (s - 1) / (steps - 1)
        late = colour_collapses and s >= 15
        colour = (
            _cat({"blue": 8}, (8.0, 8), (0.0, 2))
            if late
            else _cat({"red": 3, "green": 3, "blue": 2}, (2.0, 8), (0.0, 2))
        )
        rows.append(
            {
                "step": s,
                "member": "b",
                "answer_entropy_batch": 1.6,
                "agreement": 0.6 + 0.2 * t,
                "unanimous_rate": 0.5 + 0.2 * t,
                "pseudo_label_acc": 0.5 + 0.25 * t,
                "category_stats": {"color": colour, "yes/no": _cat({"yes": 20, "no": 20}, (30.0, 40), (8.0, 10), 10)},
            }
        )
    return rows


def test_a_category_collapse_under_a_healthy_batch_is_flagged_inside_the_category_only():
    rows, found = reproduction(), []
    for s in range(len(rows)):
        found += flag_step(rows[:s], [rows[s]])  # as the loop does: rows[s] gets its flags, then joins history
    assert rows[-1]["collapse_flag"] == 1 and rows[-1]["collapse_on"] == ["color"]
    assert [(w["category"], w["rule"]) for w in found] == [("color", "one_answer")]
    w = found[0]
    assert w["slot"] == "b" and 15 <= w["step"] <= 30 and w["top_answer_late"] == "blue"
    assert w["agreement_late"] == 1.0 and w["answer_entropy_late"] == 0.0 and w["answer_entropy_early"] > 1.0
    # the batch rule stays silent: pseudo-label accuracy rose (what hid the reproduction's collapse)
    assert [x["category"] for x in collapse_warnings(rows)] == ["color"]
    json.dumps(found)


def test_a_confident_healthy_category_is_not_flagged():
    # each question answered the same K times (sure of itself), but the category's answers still vary
    rows = reproduction(colour_collapses=False)
    for i, row in enumerate(rows):
        answer = ("red", "green", "blue", "yellow")[i % 4]
        row["category_stats"]["color"] = _cat({answer: 8}, (8.0, 8), (2.0, 2))
    assert collapse_warnings(rows) == []
    # the one-answer rule needs early diversity: a category answered "blue" from the start is not a collapse
    rows = reproduction(colour_collapses=False)
    for row in rows:
        row["category_stats"]["color"] = _cat({"blue": 8}, (8.0, 8), (0.0, 2))
    assert collapse_warnings(rows) == []


def test_eval_drops_against_step_0():
    n = {"n_color": 20, "n_shape": 20}
    rows = [
        {"step": 0, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.9, "accuracy_shape": 0.4, **n},
        {"step": 10, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.75, "accuracy_shape": 0.1, **n},
        {"step": 20, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.2, "accuracy_shape": 0.1, **n},
    ]
    found = eval_drops(rows, 0.2)
    assert [(w["step"], w["category"], w["accuracy_step0"], w["accuracy"]) for w in found] == [
        (10, "shape", 0.4, 0.1),
        (20, "color", 0.9, 0.2),
    ]
    # shape 8/20 -> 2/20 by hand: pooled p = 0.25, se = sqrt(0.25 * 0.75 * 0.1) = 0.1369, z = 0.3 / 0.1369
    assert found[0]["z"] == pytest.approx(0.3 / math.sqrt(0.25 * 0.75 * 0.1), abs=0.01)
    assert eval_drops(rows[1:], 0.2) == []  # no step-0 baseline, no flag
    # on 5 questions a category, shape's fall is within the noise (z = 1.1), colour's is not (z = 2.2)
    few = [{**r, "n_color": 5, "n_shape": 5} for r in rows]
    assert [(w["step"], w["category"]) for w in eval_drops(few, 0.2)] == [(20, "color")]
    assert "fell from 0.900 at step 0 to 0.200 at step 20" in stop_message(found[1], "stop", None)


def test_eval_drops_compare_with_step_0_and_weigh_each_evaluation_by_its_own_count():
    """Two references a fall could be read against by mistake (issue 32, item 9). Colour slides 0.9 -> 0.8 ->
    0.65 on 200 questions: 0.1 and 0.15 from one evaluation to the next, 0.25 from step 0, so only step 20 is
    flagged (the bug: the previous evaluation as the reference flags nothing). And the z of a fall pools each
    side with its own count: 0.9 of 100 -> 0.5 of 10 by hand: pooled p = 95/110, se = sqrt(p (1 - p) (1/100 +
    1/10)) = 0.1138, z = 0.4 / 0.1138 = 3.51 (the counts swapped: p = 59/110, z = 2.42, under a z of 3)."""
    gradual = [
        {"step": step, "member": "b", "benchmark": "easyvqa", "accuracy_color": acc, "n_color": 200}
        for step, acc in ((0, 0.9), (10, 0.8), (20, 0.65))
    ]
    assert [(w["step"], w["accuracy_step0"], w["accuracy"]) for w in eval_drops(gradual, 0.2)] == [(20, 0.9, 0.65)]
    uneven = [
        {"step": 0, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.9, "n_color": 100},
        {"step": 10, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.5, "n_color": 10},
    ]
    p = 95 / 110
    assert 0.4 / math.sqrt(p * (1 - p) * (1 / 100 + 1 / 10)) == pytest.approx(3.514, abs=1e-3)
    assert [w["z"] for w in eval_drops(uneven, 0.2, z=3.0)] == [3.51]


def test_a_category_warning_names_its_early_and_late_windows():
    """The evidence's step ranges: the first w rows (early) and the last w (late), w the window at the flagged
    step. Pins `collapse.category_evidence` (the bug: the two ranges swapped in the warning and the log)."""
    (w,) = collapse_warnings(reproduction())
    size = window_size(w["step"])
    assert w["early_steps"] == [1, size] and w["late_steps"] == [w["step"] - size + 1, w["step"]]


def test_rollback_sets_aside_the_checkpoints_from_the_first_flag_on(tmp_path):
    for step in (10, 20, 30):
        ckpt = tmp_path / "checkpoints" / f"step-{step}"
        (ckpt / "m").mkdir(parents=True)
        (ckpt / "m" / "config.json").write_text("{}")
        (ckpt / "m" / "model.safetensors").write_text("x")
        (ckpt / "manifest.json").write_text(
            json.dumps({"step": step, "members": {"m": ["config.json", "model.safetensors"]}})
        )
        torch.save({"step": step}, ckpt / "cohort_state.pt")
    kept = roll_back(tmp_path, 20)
    assert kept == tmp_path / "checkpoints" / "step-10"
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-10"]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "collapsed").iterdir()) == ["step-20", "step-30"]


def test_the_report_draws_category_curves_with_the_flags(tmp_path):
    from vlm_corl.reporting.markdown import RunData, category_lines, render_plots

    rows = reproduction()
    for i, row in enumerate(rows):
        row.update(window_metrics([r["category_stats"] for r in rows[max(0, i - 9) : i + 1]]))
    lines = category_lines(rows)
    assert sorted(lines) == ["b: color", "b: yes/no"] and lines["b: color"][-1]["agreement"] == 1.0
    evals = [{"step": s, "member": "b", "benchmark": "easyvqa", "accuracy_color": a} for s, a in ((0, 0.9), (20, 0.1))]
    plots = render_plots(RunData(tmp_path, rows, evals, {"collapse_warnings": collapse_warnings(rows)}), tmp_path)
    assert {"categories", "eval_categories"} <= set(plots) and plots["categories"].stat().st_size > 10_000


def _one_answer_rows(late_answers: int, steps: int = 10) -> list[dict]:
    """A category whose early answers are diverse and whose late ones are all "red" (`late_answers` in the late
    window's 5 steps), agreement 1.0 throughout and unanimity flat, so only the one-answer rule can fire."""
    rows = []
    for step in range(1, steps + 1):
        late = step > steps // 2
        per_step = late_answers // (steps // 2) if late else 4
        answers = {"red": per_step} if late else {"red": 1, "blue": 1, "green": 1, "gray": 1}
        cat = _cat(answers, (float(per_step), per_step), (0.0, 0), questions=max(per_step, 1))
        rows.append({"step": step, "member": "m", "category_stats": {"colour": cat}})
    return rows


def test_the_one_answer_rule_needs_its_minimum_of_pooled_answers():
    """rule.min_pooled_answers (8): 5 late answers of one colour are too few to call a collapse; 10 are enough; a
    rule asking for 12 does not fire on 10 (issue 23: a detector ignoring the minimum survived the tests)."""
    from vlm_corl.training.monitor.collapse import CollapseRule, category_evidence

    few, enough = _one_answer_rows(5), _one_answer_rows(10)
    assert category_evidence(few, len(few)) == []
    flagged = category_evidence(enough, len(enough))
    assert [(e["category"], e["rule"], e["top_answer_late"]) for e in flagged] == [("colour", "one_answer", "red")]
    assert category_evidence(enough, len(enough), CollapseRule(min_pooled_answers=12)) == []


def test_the_trend_rule_needs_an_absolute_fall_of_answer_entropy():
    """rule.min_diversity_drop_abs (0.05 nats) beside the relative 30 %: 0.10 -> 0.06 nats is a 40 % fall but only
    0.04 nats, not flagged; 0.10 -> 0.04 is; a floor raised to 0.5 nats keeps 1.0 -> 0.6 (40 %) from firing."""
    from vlm_corl.training.monitor.collapse import CollapseRule, trend_flagged

    rises = [(0.5, 0.8)]  # agreement rose by 0.3
    no_gold = (None, None)
    assert not trend_flagged((0.10, 0.06), rises, no_gold)
    assert trend_flagged((0.10, 0.04), rises, no_gold)
    assert trend_flagged((1.0, 0.6), rises, no_gold)
    assert not trend_flagged((1.0, 0.6), rises, no_gold, CollapseRule(min_diversity_drop_abs=0.5))
    assert not trend_flagged((1.0, 0.6), rises, no_gold, CollapseRule(min_diversity_drop=0.5))  # the relative one
    assert not trend_flagged((1.0, 0.6), [(0.5, 0.55)], no_gold)  # agreement must rise by 0.10
    assert not trend_flagged((1.0, 0.6), rises, (0.8, 0.78))  # with gold, pseudo-label accuracy must fall 0.05


def test_eval_drop_threshold_is_the_configured_one():
    """eval.max_category_drop away from its default 0.2: colour 0.9 -> 0.75 (a 0.15 fall) is flagged at 0.1 and
    not at 0.2; shape 0.4 -> 0.1 (0.3) is flagged at 0.25, not at 0.35."""
    n = {"n_color": 200, "n_shape": 200}
    rows = [
        {"step": 0, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.9, "accuracy_shape": 0.4, **n},
        {"step": 10, "member": "b", "benchmark": "easyvqa", "accuracy_color": 0.75, "accuracy_shape": 0.1, **n},
    ]
    assert [w["category"] for w in eval_drops(rows, 0.1)] == ["color", "shape"]
    assert [w["category"] for w in eval_drops(rows, 0.2)] == ["shape"]
    assert [w["category"] for w in eval_drops(rows, 0.25)] == ["shape"]
    assert eval_drops(rows, 0.35) == []


def test_the_category_window_keeps_the_configured_number_of_steps():
    """logging.category_window: the running per-category means cover the window's last steps (the tracker keeps
    window - 1 earlier rows per slot; the step's own row makes the window)."""
    from vlm_corl.training.monitor.collapse import CollapseTracker

    tracker = CollapseTracker(recent=2)  # category_window 3
    for step in range(1, 6):
        tracker.add({"step": step, "member": "m", "category_stats": {"c": _cat({"x": step}, (1.0, 1), (0.0, 0))}})
    assert [r["step"] for r in tracker.recent["m"]] == [4, 5]
    merged = window_metrics([r["category_stats"] for r in tracker.recent["m"]])
    assert merged["category/c/questions"] == 4  # two steps of 2 questions, not five

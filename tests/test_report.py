"""Run report (issue 5, item 4): report.md and PNGs from a hand-written run directory, and the plotting API."""

from __future__ import annotations

import json

from cohort_helpers import write_jsonl
from matplotlib.figure import Figure

from vlm_corl.commands.report import main
from vlm_corl.reporting.markdown import render_report
from vlm_corl.reporting.run_plots import (
    LEGEND_INSIDE,
    Look,
    by_member,
    draw_metric,
    first_last,
    moving_average,
    per_step,
    plot_metric,
    plot_panel,
    side_by_side,
)

PNG = b"\x89PNG\r\n\x1a\n"


def synthetic_rows(steps: int = 30, slots=("qwen", "llama"), collapse: bool = True) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        t = (s - 1) / (steps - 1)
        for i, slot in enumerate(slots):
            fall = t if collapse else 0.1 * t
            rows.append(
                {
                    "step": s,
                    "member": slot,
                    "reward_mean": 0.3 + 0.5 * t,
                    "reward_std": 0.4 - 0.2 * t,
                    "agreement": 0.4 + 0.5 * t,
                    "abstain_rate": 0.0,
                    "distinct_answers": 2.5 - 1.4 * t,
                    "answer_entropy": 0.9 - 0.8 * t,
                    "answer_entropy_batch": 2.0 * (1 - fall) + 0.05 * i,
                    "unparsed_rate": 0.1,
                    "response_len": 6 + i,
                    "pseudo_label_acc": 0.6 - 0.3 * t,
                    "answer_acc": 0.5 - 0.2 * t,
                    "unanimous_rate": 0.2 + 0.7 * t,
                    "unanimous_wrong_rate": 0.1 + 0.3 * t,
                    "loss": 0.01 * (-1) ** s if i == 0 else None,
                    "grad_norm": 1.0 + t if i == 0 else None,
                    "lr": 1e-3,
                    "tokens_per_s": 100.0,
                }
            )
    return rows


def test_report_on_a_synthetic_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", synthetic_rows())
    write_jsonl(
        run / "eval.jsonl",
        [
            {"step": s, "member": m, "benchmark": "easyvqa", "accuracy": a, "n": 64, "accuracy_yes/no": a + 0.1}
            for s, (qa, la) in ((0, (0.4, 0.3)), (15, (0.45, 0.35)), (30, (0.5, 0.2)))
            for m, a in (("qwen", qa), ("llama", la))
        ],
    )
    (run / "summary.json").write_text(json.dumps({"steps": 30, "reward_mode": "ring"}))  # no collapse_warnings key
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out)]) == 0  # the CLI, in process
    report = (out / "report.md").read_text()
    for stem in (
        "reward",
        "agreement",
        "pseudo_label_acc",
        "diversity",
        "unanimous",
        "length",
        "optim",
        "eval_accuracy",
    ):
        png = out / f"{stem}.png"
        assert png.read_bytes()[:8] == PNG, stem
        assert f"]({stem}.png)" in report
    assert "reward: `ring`" in report
    assert "**qwen** at step" in report and "**llama** at step" in report  # recomputed from metrics.jsonl
    assert "| metric | qwen | llama |" in report
    assert "| reward (mean) | 0.343 → 0.757 (+0.414)" in report  # mean of the first/last 6 of 30 steps
    assert "| qwen | easyvqa | 0 → 30 | 0.400 → 0.500 (+0.100)" in report
    assert not (run / "report.md").exists()  # --out respected


def test_report_uses_summary_warnings_and_works_without_eval(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", synthetic_rows(12, collapse=False))
    (tmp_path / "summary.json").write_text(json.dumps({"collapse_warnings": []}))
    report = render_report(tmp_path).read_text()
    assert "## Collapse warnings\n\nNone" in report and "Evaluation" not in report
    assert not (tmp_path / "eval_accuracy.png").exists()


def test_plot_api_one_line_per_method(tmp_path):
    seed0, seed1 = synthetic_rows(20), synthetic_rows(20, collapse=False)
    runs = {"co-rl": seed0 + seed1, "self_vote": synthetic_rows(20, slots=("m",))}
    path = plot_metric(runs, "agreement", tmp_path / "a" / "agreement.png", "Agreement")
    assert path.read_bytes()[:8] == PNG
    assert plot_metric(runs, "no_such_key", tmp_path / "x.png") is None and not (tmp_path / "x.png").exists()
    assert plot_panel(runs, ["agreement", "no_such_key", "answer_entropy_batch"], tmp_path / "p.png").exists()
    # a line = the mean over all its rows (slots, seeds) at each step
    steps, means, stds = per_step(runs["co-rl"], "answer_entropy_batch")
    assert steps == list(range(1, 21)) and len(means) == 20 and stds[-1] > 0
    assert per_step(seed0, "loss")[0] == list(range(1, 21))  # None values skipped
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5] and moving_average([5], 1) == [5]
    assert list(by_member(seed0)) == ["qwen", "llama"]
    assert first_last(by_member(seed0)["qwen"], "reward_mean")[0] < 0.4


def test_an_ema_teacher_draws_no_reward_line_but_keeps_its_colour_place(tmp_path):
    from vlm_corl.reporting.run_plots import load_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "member": m, "reward_mean": 0.5} for s in (1, 2) for m in ("a", "a.teacher", "b")]
    write_jsonl(run_dir / "metrics.jsonl", rows)
    (run_dir / "config.yaml").write_text("members:\n  - {id: a, model: x}\n  - {id: b, model: y}\n")
    learners = load_run(run_dir).learners()
    assert list(learners) == ["a", "a.teacher", "b"] and learners["a.teacher"] == [] and len(learners["b"]) == 2
    (run_dir / "config.yaml").unlink()  # members unknown: every slot is drawn
    assert len(load_run(run_dir).learners()["a.teacher"]) == 2


def test_many_lines_share_one_legend_below_the_plots_few_keep_their_own():
    """A cohort's per-category figure has a line per (member, category): 24 for four members and their EMA
    teachers. Each plot's own legend of 24 covered it, so past LEGEND_INSIDE lines one legend goes below."""
    rows = [{"step": s, "agreement": 0.5, "answer_acc": 0.6} for s in (1, 2, 3)]
    for n, shared in ((LEGEND_INSIDE + 16, True), (2, False)):
        lines = {f"m{i}: c": rows for i in range(n)}
        fig = side_by_side(
            lines, ["agreement", "answer_acc"], lambda k, ax, lines=lines: draw_metric(ax, lines, k, Look(smooth=1))
        )
        assert [ax.get_legend() is None for ax in fig.axes] == [shared, shared]
        assert len(fig.legends) == shared and (not shared or len(fig.legends[0].get_texts()) == n)


def test_the_update_numbers_get_a_plot_and_table_rows_and_steps_tick_as_whole_numbers(tmp_path):
    """Issue 56: entropy, KL and the clip fractions in report.md (KL absent: algo.kl_beta 0), and a 3-step
    run's step axis ticks 1, 2, 3 (matplotlib's default ticks read 1.25, 1.5 ...)."""
    rows = synthetic_rows(3)
    for row in rows:
        row |= {"entropy": 1.0 - 0.1 * row["step"], "kl": None, "clip_frac": 0.02 * row["step"]}
    write_jsonl(tmp_path / "metrics.jsonl", rows)
    report = render_report(tmp_path).read_text()
    assert (tmp_path / "update.png").read_bytes()[:8] == PNG and "](update.png)" in report
    assert "| entropy (nats / token) | 0.900 → 0.700 (-0.200)" in report and "| KL" not in report  # no value: no row
    fig = Figure()
    ax = fig.add_subplot()
    assert draw_metric(ax, by_member(rows), "clip_frac")
    low, high = ax.get_xlim()
    shown = [t for t in ax.get_xticks() if low <= t <= high]
    assert shown == [1.0, 2.0, 3.0]

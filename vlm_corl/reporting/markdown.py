"""The Markdown report of one run: report.md, its PNGs and samples.md (`corl report` writes it beside
report.html, vlm_corl.reporting.html).

Reads the run's metrics.jsonl (one row per slot per step), eval.jsonl (if present) and summary.json (if present)
and writes into the output directory: report.md, and PNGs of reward, the policy update (entropy, KL, clip
fractions), agreement, pseudo-label accuracy, answer diversity, unanimity, response length, loss/grad norm (one
line per slot over steps) and eval accuracy (one line per member and benchmark), a first-vs-last table per slot,
and the collapse warnings (vlm_corl.training.monitor.collapse).
With per-category metrics (logging.category_key) and per-category evaluation, `categories.png` and
`eval_categories.png` draw one line per slot and category, with the collapse flags as dashed lines.

The reading and plotting functions are in vlm_corl.reporting.run_plots.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from vlm_corl import cli
from vlm_corl.reporting.run_plots import (
    LABELS,
    Look,
    Rows,
    RunData,
    _number,
    by_member,
    category_figure,
    category_lines,
    clean_text,
    draw_metric,
    edge_window,
    eval_category_lines,
    eval_lines,
    first_last,
    load_run,
    mark_flags,
    plot_metric,
    plot_panel,
    read_jsonl,
)
from vlm_corl.training.monitor.collapse import collapse_warnings, describe
from vlm_corl.training.monitor.samples import markdown_text, sample_markdown

# (file stem, figure title, keys drawn side by side, cohort-level: one line instead of one per slot)
RUN_PLOTS = (
    ("reward", "Reward", ("reward_mean", "reward_std"), False),
    (
        "update",
        "Policy update (trained members)",
        ("entropy", "kl", "clip_frac", "clip_frac_low", "clip_frac_high"),
        False,
    ),
    ("agreement", "Agreement with the pseudo-label", ("agreement", "abstain_rate"), False),
    (
        "pseudo_label_acc",
        "Pseudo-label and answer accuracy (gold, diagnostic only)",
        ("pseudo_label_acc", "answer_acc"),
        False,
    ),
    ("diversity", "Answer diversity", ("distinct_answers", "answer_entropy", "answer_entropy_batch"), False),
    ("unanimous", "Cohort unanimity", ("unanimous_rate", "unanimous_wrong_rate"), True),
    ("length", "Responses", ("response_len", "unparsed_rate"), False),
    ("optim", "Optimisation", ("loss", "grad_norm"), False),
)
LEARNERS = ("reward", "update")  # an EMA teacher earns no reward and takes no update: no line for it
TABLE_KEYS = (
    "reward_mean",
    "entropy",
    "kl",
    "clip_frac",
    "agreement",
    "pseudo_label_acc",
    "answer_acc",
    "distinct_answers",
    "answer_entropy",
    "answer_entropy_batch",
    "unanimous_rate",
    "unanimous_wrong_rate",
    "response_len",
    "unparsed_rate",
    "abstain_rate",
    "loss",
    "grad_norm",
)
# ---- the report ---------------------------------------------------------------------------------------


def _fmt(v, sign: str = "") -> str:
    if v is None:
        return "–"
    return f"{v:{sign}.3f}" if v == 0 or 0.01 <= abs(v) < 100 else f"{v:{sign}.3g}"


def _move(first, last) -> str:
    if first is None or last is None:
        return "–"
    return f"{_fmt(first)} → {_fmt(last)} ({_fmt(last - first, '+')})"


def first_last_table(rows: Rows, keys: Sequence[str] = TABLE_KEYS) -> list[str]:
    """Markdown table: one line per metric, one column per slot, "first → last (Δ)"."""
    slots = by_member(rows)
    lines = ["| metric | " + " | ".join(slots) + " |", "|---|" + "---|" * len(slots)]
    for key in keys:
        cells = [_move(*first_last(slot_rows, key)) for slot_rows in slots.values()]
        if all(c == "–" for c in cells):
            continue
        lines.append(f"| {LABELS.get(key, key)} | " + " | ".join(cells) + " |")
    return lines


def eval_table(eval_rows: Rows) -> list[str]:
    """Markdown table: first and last evaluation per member and benchmark (overall and per question type)."""
    keys = sorted({k for r in eval_rows for k in r if k.startswith("accuracy_")})
    header = ["member", "benchmark", "steps", "accuracy", *(k.removeprefix("accuracy_") for k in keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rows in eval_lines(eval_rows).values():
        rows = sorted(rows, key=lambda r: r["step"])
        first, last = rows[0], rows[-1]
        cells = [
            _move(first.get(k), last.get(k)) if _number(first.get(k)) and _number(last.get(k)) else "–"
            for k in ("accuracy", *keys)
        ]
        member, bench = last["member"], last.get("benchmark", "?")
        lines.append(f"| {member} | {bench} | {first['step']} → {last['step']} | " + " | ".join(cells) + " |")
    return lines


def render_plots(run: RunData, out: Path, smooth: int = 5) -> dict[str, Path]:
    """The run's PNGs into `out`: {stem: path} for the plots that had data."""
    slots = by_member(run.rows)
    written = {}
    for stem, title, keys, cohort_level in RUN_PLOTS:
        lines = {"cohort": list(run.rows)} if cohort_level else run.learners() if stem in LEARNERS else slots
        path = plot_panel(lines, keys, Path(out) / f"{stem}.png", title, smooth=smooth)
        if path is not None:
            written[stem] = path
    if run.eval_rows:
        path = plot_metric(
            eval_lines(run.eval_rows),
            "accuracy",
            Path(out) / "eval_accuracy.png",
            "Eval accuracy",
            smooth=1,
            band=False,
        )
        if path is not None:
            written["eval_accuracy"] = path
    warnings = run.summary.get("collapse_warnings") or collapse_warnings(run.rows)
    fig = category_figure(category_lines(run.rows), warnings, "Per category (running windows; dashed: collapse flags)")
    if fig is not None:
        written["categories"] = _save(fig, Path(out) / "categories.png")
    if any(k.startswith("accuracy_") for r in run.eval_rows for k in r):
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        ax = fig.add_subplot()
        look = Look(title="Eval accuracy per category (dashed: drops flagged)", smooth=1, band=False)
        draw_metric(ax, eval_category_lines(run.eval_rows), "accuracy", look)
        mark_flags(ax, [w for w in warnings if w.get("rule") == "eval_drop"])
        written["eval_categories"] = _save(fig, Path(out) / "eval_categories.png")
    return written


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def collapse_section(run) -> tuple[list[str], str]:
    """The report's collapse warnings (from summary.json, or recomputed from the metrics when the run has no
    summary yet), the guard's stop if it stopped the run, and where the warnings came from."""
    md = ["", "## Collapse warnings", ""]
    if "collapse_warnings" in run.summary:
        warnings, source = run.summary["collapse_warnings"], "summary.json"
    else:
        warnings, source = collapse_warnings(run.rows), "recomputed from metrics.jsonl"
    if warnings:
        md += [
            f"- **{w['slot']}**"
            + (f" in category {markdown_text(repr(w['category']))}" if w.get("category") is not None else "")
            + f" at step {w['step']}: {describe(w)}"
            for w in warnings
        ]
    else:
        md.append(
            "None: no slot's answer diversity fell while its agreement rose (and, with gold diagnostics, "
            "its pseudo-label accuracy fell), in the batch or inside a category."
        )
    if run.summary.get("stopped_by_guard"):
        stop = run.summary["stopped_by_guard"]
        md += [
            "",
            f"**The run was stopped by the collapse guard** (train.on_collapse={stop['action']}) at step "
            f"{stop['warning']['step']}.",
        ]
    return md, source


def render_report(run_dir: Path, out: Path | None = None, smooth: int = 5) -> Path:
    """Write report.md and the PNGs of the run in `run_dir` into `out` (default: the run directory)."""
    run = load_run(run_dir)
    out = cli.output_dir(out if out is not None else run_dir, "--out")
    plots = render_plots(run, out, smooth)
    s = run.summary
    steps = sorted({r["step"] for r in run.rows})
    md = [f"# Run report: {Path(run_dir).resolve().name}", ""]
    md.append(f"- run directory: `{Path(run_dir).resolve()}`")
    if s.get("reward_mode"):
        md.append(f"- reward: `{s['reward_mode']}`")
    md.append(
        f"- logged steps: {len(steps)}"
        + (f" ({steps[0]}–{steps[-1]})" if steps else "")
        + (f" of {s['steps']}" if s.get("steps") else "")
    )
    md.append(f"- slots: {', '.join(by_member(run.rows)) or '–'}")
    warning_lines, source = collapse_section(run)
    md += warning_lines
    md += ["", f"_Source: {source}; rule in `vlm_corl.training.monitor.collapse`._", ""]
    n = len(steps)
    md += [
        "## First vs last",
        "",
        f"Mean over the first and the last {edge_window(n)} logged step(s) of each slot.",
        "",
    ]
    md += first_last_table(run.rows)
    if run.eval_rows:
        md += ["", "## Evaluation", ""] + eval_table(run.eval_rows)
    md += ["", "## Plots", ""]
    md.append(
        f"One line per slot (cohort-level metrics: one line); faint: per step, bold: moving average over "
        f"{smooth} logged steps."
    )
    for stem, path in plots.items():
        md += ["", f"![{stem}]({path.relative_to(out).as_posix()})"]
    samples = render_samples(Path(run_dir), out)
    if samples is not None:
        md += ["", "## What the members answered", "", f"[{samples.name}]({samples.name}): the sampled questions"]
    report = out / "report.md"
    report.write_text(clean_text("\n".join(md) + "\n"), encoding="utf-8")
    return report


def render_samples(run_dir: Path, out: Path, last: int = 50) -> Path | None:
    """samples.md from the run's samples.jsonl (its `last` rows; None without any): each question with its
    picture (copied beside the page) and every member's responses, answers, vote, label and rewards."""
    rows = read_jsonl(run_dir / "samples.jsonl") if (run_dir / "samples.jsonl").is_file() else []
    if not rows:
        return None
    pictures = out / "sample_images"
    md = [f"# What the members answered: {Path(run_dir).resolve().name}", ""]
    md.append(
        f"The last {min(last, len(rows))} of {len(rows)} sampled questions (logging.samples_every). A label comes "
        "from the slots named after it; gold is shown for diagnosis only (label-free rewards never read it)."
    )
    for row in rows[-last:]:
        image = None
        source = Path(row["image"]) if row.get("image") else None
        if source is not None and source.is_file():
            pictures.mkdir(parents=True, exist_ok=True)
            target = pictures / picture_name(row["example_id"], source.suffix)
            shutil.copyfile(source, target)
            image = target.relative_to(out).as_posix()
        md += ["", "---", "", sample_markdown(row, image)]
    page = out / "samples.md"
    page.write_text(clean_text("\n".join(md) + "\n"), encoding="utf-8")
    return page


def picture_name(example_id: str, suffix: str) -> str:
    """The file name of an example's picture beside samples.md: the id's letters, digits, `.`, `_`, `-` (the
    rest as `_`) and a hash of the whole id, so no id names a path (`../../x`, `a/b`) and two ids never share
    a file; `suffix` kept when it is a plain extension."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", example_id).strip("._-")[:60] or "example"
    digest = hashlib.sha256(example_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{slug}-{digest}" + (suffix.lower() if re.fullmatch(r"\.[A-Za-z0-9]{1,8}", suffix) else "")

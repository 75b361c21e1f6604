"""Reading a run directory (metrics, evaluation, summary) and plotting its series, for report.md and report.html.

Plotting API, reusable across runs (an experiment script draws one line per METHOD):

    plot_metric(runs, key, path, title=None, *, smooth=5, band=True) -> Path | None
    draw_metric(ax, runs, key, Look(title, ylabel, smooth, band)) -> bool
    plot_panel(runs, keys, path, title=None, *, smooth=5, titles=None) -> Path | None

`runs` maps a line's label to a list of metrics rows (dicts with "step" and the key), e.g.
``{"Co-RL ring": rows_seed0 + rows_seed1, "self_vote": ..., "gt": ...}``. Each label is ONE line: at every
step, the mean of `key` over all that label's rows at that step (all slots and all runs/seeds given; None and
missing values skipped); with `band`, a shaded ±1 std across those rows when there are several. The per-step
mean is drawn faint and its trailing moving average over `smooth` logged steps (1 = no smoothing) bold in the
same colour. A label without values is left out; when no label has any, nothing is written and None is
returned. `draw_metric(some_axes, ...)` draws the same lines into an existing matplotlib Axes and writes
nothing, so callers can compose their own figures. `by_member(rows)` splits one run into lines per slot
and `eval_lines(eval_rows)` gives one line per (member, benchmark) of eval.jsonl rows (key "accuracy" or
"accuracy_<type>"). Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend state).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vlm_corl.errors import UserError
from vlm_corl.training.monitor.category_metrics import path_safe

if TYPE_CHECKING:
    from matplotlib.axes import Axes

Rows = Sequence[dict]

LABELS = {
    "reward_mean": "reward (mean)",
    "reward_std": "reward (std)",
    "abstain_rate": "abstain rate",
    "pseudo_label_acc": "pseudo-label accuracy",
    "answer_acc": "answer accuracy",
    "distinct_answers": "distinct answers / group",
    "answer_entropy": "answer entropy / group (nats)",
    "answer_entropy_batch": "answer entropy, batch (nats)",
    "unanimous_rate": "unanimous rate",
    "unanimous_wrong_rate": "unanimous & wrong rate",
    "response_len": "response length (tokens)",
    "unparsed_rate": "unparsed rate",
    "grad_norm": "grad norm",
    "entropy": "entropy (nats / token)",
    "kl": "KL (nats / token)",
    "clip_frac": "clipped share",
    "clip_frac_low": "clipped share, low",
    "clip_frac_high": "clipped share, high",
    "accuracy": "eval accuracy",
}


# ---- reading ------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file (none if it is absent). The last line of a running job's file may be half
    written: it is left out; an unreadable line elsewhere is a UserError naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for i, line in lines:
        try:
            row = json.loads(line)
            rows.append(clean_json(row) if _SURROGATE.search(line) else row)
        except json.JSONDecodeError as err:
            if i == lines[-1][0]:
                print(f"[report] {path}: line {i} is incomplete (a run still writing?), left out", file=sys.stderr)
                continue
            raise UserError(f"{path} line {i} is not JSON ({err.msg}): is this a training run's metrics file?") from err
    return rows


# A JSON escape of a UTF-16 surrogate: only a line holding one can decode to a string that cannot be written
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def clean_text(text: str) -> str:
    """`text` with each lone surrogate (JSON's "\\ud800", a file name that is not UTF-8) replaced by U+FFFD: a
    string holding one can be neither written to a UTF-8 file nor drawn by matplotlib."""
    return text if text.isascii() else text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def clean_json(value):
    """`value` (parsed JSON) with `clean_text` applied to every string in it, keys included."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [clean_json(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(k): clean_json(v) for k, v in value.items()}
    return value


def literal(text: str) -> str:
    """`text` for a matplotlib label, shown as written: a `$` escaped (two would start mathtext, which draws
    "$5 and $10" as maths and fails on "$\\frac{$"), a leading `_` kept in the legend (matplotlib leaves out
    labels starting with one) and lone surrogates replaced."""
    text = clean_text(str(text)).replace("$", r"\$")
    return "\u200b" + text if text.startswith("_") else text


@dataclass
class RunData:
    """What a run directory holds for the report."""

    run_dir: Path
    rows: list[dict]  # metrics.jsonl
    eval_rows: list[dict] = field(default_factory=list)  # eval.jsonl
    summary: dict = field(default_factory=dict)  # summary.json
    members: list[str] = field(default_factory=list)  # config.yaml's member ids ([]: unknown)

    def learners(self) -> dict[str, Rows]:
        """{slot: its rows}, an EMA teacher's slot (`<id>.teacher`, a slot that is no member) with none: it earns
        no reward. Its key stays, so every slot keeps its colour across plots. Every slot's rows when the members
        are unknown."""
        slots = by_member(self.rows)
        return {k: (v if k in self.members else []) for k, v in slots.items()} if self.members else slots


def load_run(run_dir: Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist (the output_dir of a training run)")
    if not (run_dir / "metrics.jsonl").exists():
        raise UserError(f"{run_dir}/metrics.jsonl not found: is this a training run directory (output_dir)?")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise UserError(f"{run_dir}/metrics.jsonl has no rows yet: a run writes one per step (logging.every)")
    _check_one_run(run_dir / "metrics.jsonl", rows)
    summary_path = run_dir / "summary.json"
    try:
        summary = summary_path.read_text(encoding="utf-8", errors="replace") if summary_path.exists() else "{}"
        summary = clean_json(json.loads(summary))
    except json.JSONDecodeError as err:
        raise UserError(f"{summary_path} is not JSON ({err.msg}); move it away to report from metrics.jsonl") from err
    return RunData(run_dir, rows, read_jsonl(run_dir / "eval.jsonl"), summary, _member_ids(run_dir / "config.yaml"))


def _member_ids(config: Path) -> list[str]:
    """The member ids a run's saved config.yaml lists ([] without one, or one that is unreadable)."""
    import yaml

    try:
        members = yaml.safe_load(config.read_text()).get("members") or []
    except (OSError, AttributeError, yaml.YAMLError):
        return []
    return [clean_text(str(m["id"])) for m in members if isinstance(m, dict) and "id" in m]


def _check_one_run(path: Path, rows: list[dict]) -> None:
    """A metrics file holds one run: one row per (step, member). Two rows for one pair mean two runs' rows (an
    old run's left in the directory, or files joined by hand), which averaged together would mislead."""
    seen: dict[tuple, int] = {}
    for line, row in enumerate(rows, 1):
        key = (row.get("step"), row.get("member"))
        if key in seen:
            raise UserError(
                f"{path} holds two rows for step {key[0]} of member {key[1]!r} (rows {seen[key]} and {line}): it "
                "mixes two runs (an old run's rows, or files joined by hand). Keep one run's rows in their own "
                "directory and report that"
            )
        seen[key] = line


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def by_member(rows: Rows) -> dict[str, list[dict]]:
    """One line per slot: rows grouped by their "member" key, in order of first appearance."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row["member"], []).append(row)
    return out


def eval_lines(eval_rows: Rows) -> dict[str, list[dict]]:
    """One line per (member, benchmark) of eval.jsonl rows, labelled "member (benchmark)"."""
    out: dict[str, list[dict]] = {}
    for row in eval_rows:
        out.setdefault(f"{row['member']} ({row.get('benchmark', '?')})", []).append(row)
    return out


CATEGORY_PREFIX = "category/"
CATEGORY_PLOT_KEYS = ("agreement", "answer_entropy_pooled", "pseudo_label_acc", "answer_acc")


def category_lines(rows: Rows) -> dict[str, list[dict]]:
    """One line per (slot, category) of the rows' running-window `category/<c>/<metric>` keys, labelled
    "slot: c" with the category's real name where `category_stats` holds it (the key's `c` is its `path_safe`
    name; a row written before keys were made safe holds "yes/no" there and joins the same line), each row
    holding the bare metric names."""
    names = {path_safe(c): c for row in rows for c in row.get("category_stats") or {}}
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(CATEGORY_PREFIX):
                category, metric = key[len(CATEGORY_PREFIX) :].rsplit("/", 1)
                safe = path_safe(category)
                names.setdefault(safe, category)
                line = out.setdefault((row["member"], safe), {})
                line.setdefault(row["step"], {"step": row["step"]})[metric] = value
    return {f"{slot}: {names[c]}": list(steps.values()) for (slot, c), steps in out.items()}


def eval_category_lines(eval_rows: Rows) -> dict[str, list[dict]]:
    """One line per (member, benchmark, category) of eval.jsonl's `accuracy_<category>` keys, labelled
    "member (benchmark): category", each row's value under "accuracy"."""
    out: dict[str, list[dict]] = {}
    for row in eval_rows:
        for key, value in row.items():
            if key.startswith("accuracy_"):
                label = f"{row['member']} ({row.get('benchmark', '?')}): {key.removeprefix('accuracy_')}"
                out.setdefault(label, []).append({"step": row["step"], "accuracy": value})
    return out


def mark_flags(ax: Axes, warnings: Sequence[dict]) -> None:
    """A dashed vertical line at each category warning's step, named "slot: category"."""
    for w in warnings:
        if w.get("category") is not None:
            ax.axvline(w["step"], color="red", linestyle="--", linewidth=1.0, alpha=0.7)
            ax.annotate(
                literal(f"{w['slot']}: {w['category']}"),
                (w["step"], 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize="x-small",
                color="red",
            )


# ---- numbers ------------------------------------------------------------------------------------------


def per_step(rows: Rows, key: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean, std) of `key` over the rows at each step (None / missing skipped; std 0 for one row)."""
    values: dict[int, list[float]] = {}
    for row in rows:
        v = row.get(key)
        if _number(v):
            values.setdefault(row["step"], []).append(float(v))
    steps = sorted(values)
    means = [statistics.fmean(values[s]) for s in steps]
    stds = [statistics.pstdev(values[s]) if len(values[s]) > 1 else 0.0 for s in steps]
    return steps, means, stds


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average: point i is the mean of values[max(0, i - window + 1) : i + 1]."""
    window = max(1, int(window))
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def edge_window(n: int) -> int:
    """Steps averaged for the "first" and "last" values of the report's table: clamp(n // 5, 1, 20)."""
    return max(1, min(20, n // 5))


def first_last(rows: Rows, key: str) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and over the last `edge_window(n)` logged steps of these rows."""
    steps, means, _ = per_step(rows, key)
    if not steps:
        return None, None
    w = edge_window(len(steps))
    return statistics.fmean(means[:w]), statistics.fmean(means[-w:])


# ---- plotting -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Look:
    """How `draw_metric` draws one metric: the axes' title, the y label (default: LABELS' for the key), the
    trailing moving average over `smooth` logged steps (1: none), and a shaded ±1 std band."""

    title: str | None = None
    ylabel: str | None = None
    smooth: int = 5
    band: bool = True


def plot_metric(
    runs: Mapping[str, Rows], key: str, path: Path, title: str | None = None, *, smooth: int = 5, band: bool = True
) -> Path | None:
    """One line per label of `runs` for metric `key` over steps (see the module docstring), written to `path`
    (PNG); returns the path, or None (nothing written) when no label has a value for `key`."""
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    if not draw_metric(fig.add_subplot(), runs, key, Look(title=title, smooth=smooth, band=band)):
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def draw_metric(ax: Axes, runs: Mapping[str, Rows], key: str, look: Look = Look()) -> bool:
    """`plot_metric`'s lines drawn into an existing matplotlib Axes (callers compose their own figures);
    False when no label has a value for `key` (nothing drawn)."""
    drawn = False
    for i, (label, rows) in enumerate(runs.items()):
        steps, means, stds = per_step(rows, key)
        if not steps:
            continue
        drawn = True
        color = f"C{i % 10}"
        marker = "o" if len(steps) <= 20 else None
        if look.smooth > 1 and len(steps) > 1:
            ax.plot(steps, means, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, moving_average(means, look.smooth), color=color, linewidth=1.8, label=literal(label))
        else:
            ax.plot(steps, means, color=color, linewidth=1.8, marker=marker, markersize=3, label=literal(label))
        if look.band and any(stds):
            lower, upper = [m - s for m, s in zip(means, stds)], [m + s for m, s in zip(means, stds)]
            ax.fill_between(steps, lower, upper, color=color, alpha=0.12, linewidth=0)
    if not drawn:
        return False
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at 1.25
    ax.set_ylabel(literal(look.ylabel or LABELS.get(key, key)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if look.title:
        ax.set_title(literal(look.title))
    return True


def plot_panel(
    runs: Mapping[str, Rows],
    keys: Sequence[str],
    path: Path,
    title: str | None = None,
    *,
    smooth: int = 5,
    titles: Mapping[str, str] | None = None,
) -> Path | None:
    """Several metrics side by side (one subplot per key with values, same lines as `plot_metric`) in one PNG;
    None (nothing written) when no key has values."""
    fig = side_by_side(
        runs, keys, lambda key, ax: draw_metric(ax, runs, key, Look(title=(titles or {}).get(key), smooth=smooth))
    )
    if fig is None:
        return None
    if title:
        fig.suptitle(literal(title), wrap=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def category_figure(lines: Mapping[str, Rows], warnings: Sequence[dict], title: str) -> Figure | None:
    """One subplot per category metric with values (`CATEGORY_PLOT_KEYS`, lines from `category_lines`), the
    batch/category collapse flags marked; None when no line has any of them (report.md's PNG, report.html's SVG)."""

    def draw(key: str, ax: Axes) -> None:
        draw_metric(ax, lines, key, Look(ylabel=f"{LABELS.get(key, key)} (window)", smooth=1, band=False))
        mark_flags(ax, [w for w in warnings if w.get("rule") != "eval_drop"])

    fig = side_by_side(lines, CATEGORY_PLOT_KEYS, draw)
    if fig is not None:
        fig.suptitle(literal(title), wrap=True)  # one plot's width: a long title was cut at both edges
    return fig


# More lines than this and side-by-side plots share one legend below them: a legend of each plot's 24 lines (4
# members, their EMA teachers, 3 categories) covered the plots and ran past them.
LEGEND_INSIDE = 8


def side_by_side(lines: Mapping[str, Rows], keys: Sequence[str], draw: Callable[[str, Axes], None]) -> Figure | None:
    """A figure of one subplot per key that some line has values of, each drawn by `draw(key, ax)`; None when
    no key has any. Over `LEGEND_INSIDE` lines, one legend below the plots replaces theirs."""
    present = [k for k in keys if any(per_step(rows, k)[0] for rows in lines.values())]
    if not present:
        return None
    shared = len(lines) > LEGEND_INSIDE  # many lines: one legend under the row, not one over each plot
    columns = min(len(lines), 2 * len(present))
    legend_rows = -(-len(lines) // columns) if shared else 0
    fig = Figure(figsize=(5.0 * len(present), 3.8 + 0.2 * legend_rows), layout="constrained")
    axes = [fig.add_subplot(1, len(present), j + 1) for j in range(len(present))]
    for key, ax in zip(present, axes):
        draw(key, ax)
    if shared:
        handles = {}
        for ax in axes:
            if ax.get_legend() is not None:
                ax.get_legend().remove()
            handles |= dict(zip(*reversed(ax.get_legend_handles_labels())))
        fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=columns, fontsize="small")
    return fig

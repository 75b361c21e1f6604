"""report.html: one self-contained page for one run or several overlaid (`corl report RUN [RUN2 ...]`).

The page needs nothing outside itself: plots are inline SVG (matplotlib), question pictures inline data URIs
(each picture once, as a CSS class its rows share), and the little JavaScript that filters and sorts the
completions table is embedded; a Content-Security-Policy forbids every request (no fonts, scripts or images are
fetched). Every text from a run (model output, questions, member ids) is HTML-escaped where the page is written:
model output such as `<answer>x</answer>` or `<script>` shows as text. Each text is written once, a prompt or
response cut at MAX_TEXT_CHARS (with a note), and the table keeps its newest rows within MAX_COMPLETIONS rows
and MAX_TABLE_BYTES. The table's filters are also read from the address (`report.html#member=q&step=3`),
so a filtered view can be linked.

Sections: the runs; per-member curves of reward, the policy update (entropy, KL, clip fractions), agreement,
pseudo-label accuracy and answer accuracy (one line per run and member; a curve no row has is named with why,
never drawn as an empty frame); evaluation curves; per-category curves with the collapse flags, and every
collapse warning in words; the member x member vote agreement (a matrix at the last step and its pairs over
time); the sampled completions (step, member, prompt, response, extracted answer, vote, label and where it came
from, reward, advantage).
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from vlm_corl.reporting.run_plots import (
    Look,
    RunData,
    by_member,
    category_figure,
    category_lines,
    clean_text,
    draw_metric,
    eval_category_lines,
    eval_lines,
    mark_flags,
    per_step,
    read_jsonl,
)
from vlm_corl.training.monitor.collapse import collapse_warnings, describe
from vlm_corl.training.monitor.metrics import PAIR_PREFIX
from vlm_corl.training.monitor.samples import MAX_TEXT_CHARS, cut_text

CURVES = (
    ("reward_mean", "Reward"),
    ("entropy", "Policy entropy (nats / response token)"),
    ("kl", "KL to the reference"),
    ("clip_frac", "Clip fraction"),
    ("clip_frac_low", "Clip fraction, low side"),
    ("clip_frac_high", "Clip fraction, high side"),
    ("agreement", "Agreement with the pseudo-label"),
    ("pseudo_label_acc", "Pseudo-label accuracy (gold, diagnostic)"),
    ("answer_acc", "Answer accuracy (gold, diagnostic)"),
)
# A trained member's own numbers: an EMA teacher earns no reward and takes no update (no line at 0 for it)
LEARNER_CURVES = {"reward_mean", "entropy", "kl", "clip_frac", "clip_frac_low", "clip_frac_high"}
# Why a curve has no value in any row: the page says so in place of an empty frame
ABSENT = {
    "kl": "logged only when algo.kl_beta > 0",
    **dict.fromkeys(("clip_frac", "clip_frac_low", "clip_frac_high"), "none under policy_loss sapo: it clips nothing"),
    "agreement": "no row has a pseudo-label: the reward mode gives none (self_certainty, entropy), or "
    "every member abstained (no answer parsed, or none over reward.vote_threshold)",
    "pseudo_label_acc": "no row has both a pseudo-label and a gold answer",
    "answer_acc": "no gold answers in the data",
}
MAX_COMPLETIONS = 3000  # table rows (one per response), the newest kept: a long run's page stays light
MAX_TABLE_BYTES = 10_000_000  # the table's rows and pictures, the newest kept (20 MB of responses made a 40 MB page)
MAX_PICTURE_BYTES = 200_000  # larger question pictures are named, not embedded

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def render_html(runs: Sequence[RunData], out: Path, smooth: int = 5) -> Path:
    """Write `out` (report.html) for `runs` (one, or several overlaid; labels are the run directories' names)."""
    names = _names(runs)
    completions, pictures = _completions(runs, names)
    sections = [
        _header(runs, names),
        _curves(runs, names, smooth),
        _evaluation(runs, names),
        _categories(runs, names),
        _agreement(runs, names),
        completions,
    ]
    title = "Co-RL report: " + ", ".join(names)
    page = PAGE.format(
        csp=CSP,
        title=html.escape(title),
        body="\n".join(s for s in sections if s),
        style=STYLE + pictures,
        script=SCRIPT,
    )
    out = Path(out)
    out.write_text(clean_text(page), encoding="utf-8")  # a directory name that is not UTF-8 is replaced, too
    return out


def _names(runs: Sequence[RunData]) -> list[str]:
    """Each run's label: its directory's name, with as many parent directories as the runs need to differ."""
    parts = [r.run_dir.resolve().parts for r in runs]
    for depth in range(1, max(map(len, parts)) + 1):
        names = [Path(*p[-depth:]).as_posix() for p in parts]
        if len(set(names)) == len(names):
            break
    return names


def _label(names: list[str], i: int, member: str) -> str:
    return member if len(names) == 1 else f"{names[i]}: {member}"


def _svg(fig: Figure) -> str:
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: searchable, and a smaller page
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return '<div class="plot">' + text[text.index("<svg") :] + "</div>"  # drop the XML prolog and DOCTYPE


def _header(runs, names) -> str:
    rows = []
    for name, run in zip(names, runs):
        s = run.summary
        steps = sorted({r["step"] for r in run.rows})
        functions = ", ".join(f"{f['name']} x{f['weight']:g}" for f in s.get("reward_functions") or [])
        data = s.get("data") or {}
        cells = [
            name,
            s.get("reward_mode", "?") + (f" + {functions}" if functions else ""),
            f"{steps[-1] if steps else 0}" + (f" of {s['steps']}" if s.get("steps") else ""),
            ", ".join(by_member(run.rows)),
            f"uses {data.get('used', data.get('kept'))}, skipped {sum((data.get('skipped') or {}).values())}"
            if data
            else "?",
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return (
        '<section id="runs"><h2>Runs</h2><table class="grid"><tr><th>run</th><th>reward</th><th>steps logged</th>'
        "<th>members</th><th>data</th></tr>" + "".join(rows) + "</table></section>"
    )


def _curves(runs, names, smooth: int) -> str:
    lines = {
        _label(names, i, member): rows for i, run in enumerate(runs) for member, rows in by_member(run.rows).items()
    }
    learners = {_label(names, i, member): rows for i, run in enumerate(runs) for member, rows in run.learners().items()}
    present = [(k, t) for k, t in CURVES if any(per_step(rows, k)[0] for rows in lines.values())]
    if not present:
        return ""
    absent = [f"{t.split(' (')[0]} ({ABSENT.get(k, f'no row has {k}')})" for k, t in CURVES if (k, t) not in present]
    fig = Figure(figsize=(5.2 * min(len(present), 2), 3.6 * ((len(present) + 1) // 2)), layout="constrained")
    for j, (key, title) in enumerate(present):
        ax = fig.add_subplot((len(present) + 1) // 2, min(len(present), 2), j + 1)
        draw_metric(ax, learners if key in LEARNER_CURVES else lines, key, Look(title=title, smooth=smooth, band=False))
    note = f"One line per member{' and run' if len(runs) > 1 else ''}; faint: per step, bold: {smooth}-step average."
    missing = f'<p class="muted" id="not-drawn">Not drawn: {html.escape("; ".join(absent))}.</p>' if absent else ""
    return f'<section id="curves"><h2>Training curves</h2><p>{note}</p>{_svg(fig)}{missing}</section>'


def _evaluation(runs, names) -> str:
    lines = {}
    for i, run in enumerate(runs):
        for label, rows in eval_lines(run.eval_rows).items():
            lines[_label(names, i, label)] = rows
    if not lines:
        return ""
    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.add_subplot()
    draw_metric(ax, lines, "accuracy", Look(title="Evaluation accuracy", smooth=1, band=False))
    return f'<section id="evaluation"><h2>Evaluation</h2>{_svg(fig)}</section>'


def _warnings(run: RunData) -> list[dict]:
    return run.summary.get("collapse_warnings") if "collapse_warnings" in run.summary else collapse_warnings(run.rows)


def _categories(runs, names) -> str:
    parts, words = [], []
    for i, run in enumerate(runs):
        warnings = _warnings(run)
        words += [
            f"<li><b>{html.escape(_label(names, i, w['slot']))}</b>"
            + (f" in category <b>{html.escape(str(w['category']))}</b>" if w.get("category") is not None else "")
            + f" at step {w['step']}: {html.escape(describe(w))}</li>"
            for w in warnings
        ]
        lines = {_label(names, i, k): v for k, v in category_lines(run.rows).items()}
        title = f"{names[i]}: per category (running windows; dashed red: collapse flags)"
        fig = category_figure(lines, warnings, title)
        if fig is not None:
            parts.append(_svg(fig))
        eval_cats = eval_category_lines(run.eval_rows)
        if eval_cats:
            fig = Figure(figsize=(6.4, 3.8), layout="constrained")
            ax = fig.add_subplot()
            look = Look(title=f"{names[i]}: eval per category", smooth=1, band=False)
            draw_metric(ax, eval_cats, "accuracy", look)
            mark_flags(ax, [w for w in warnings if w.get("rule") == "eval_drop"])
            parts.append(_svg(fig))
    said = (
        "<ul>" + "".join(words) + "</ul>"
        if words
        else "<p>No collapse warning: no member's answer diversity fell while its agreement rose.</p>"
    )
    return f'<section id="categories"><h2>Categories and collapse</h2>{said}{"".join(parts)}</section>'


def _agreement(runs, names) -> str:
    parts = []
    for i, run in enumerate(runs):
        members = list(by_member(run.rows))
        last: dict[str, dict] = {}
        for row in run.rows:
            last[row["member"]] = row  # each member's newest row
        if not any(k.startswith(PAIR_PREFIX) for row in last.values() for k in row):
            continue
        header = "".join(f"<th>{html.escape(m)}</th>" for m in members)
        body = []
        for a in members:
            cells = []
            for b in members:
                v = 1.0 if a == b else last.get(a, {}).get(PAIR_PREFIX + b)
                shade = "" if v is None else f' style="background: rgba(40, 110, 200, {0.15 + 0.7 * v:.2f})"'
                cells.append(f"<td{shade}>{'–' if v is None else f'{v:.2f}'}</td>")
            body.append(f"<tr><th>{html.escape(a)}</th>{''.join(cells)}</tr>")
        step = max(r["step"] for r in run.rows)
        parts.append(
            f"<h3>{html.escape(names[i])}: votes agreeing at step {step}</h3>"
            f'<table class="grid matrix"><tr><th></th>{header}</tr>{"".join(body)}</table>'
        )
        pairs = {}
        # the members' pairs only: with EMA teachers beside them, 28 lines are unreadable
        voters = [k for k, v in run.learners().items() if v]
        for x, a in enumerate(voters):
            for b in voters[x + 1 :]:
                rows = [{"step": r["step"], "v": r.get(PAIR_PREFIX + b)} for r in run.rows if r["member"] == a]
                pairs[f"{a} ~ {b}"] = rows
        fig = Figure(figsize=(6.4, 3.4), layout="constrained")
        look = Look(title="Vote agreement over time", ylabel="votes agreeing", smooth=5, band=False)
        if draw_metric(fig.add_subplot(), pairs, "v", look):
            parts.append(_svg(fig))
        else:  # an empty frame said nothing: say why
            why = "fewer than two members vote" if not pairs else "no two members both voted on a question"
            parts.append(f'<p class="muted no-votes">Vote agreement over time: not drawn, {why}.</p>')
    if not parts:
        return ""
    note = "Share of a step's questions on which two members' plurality votes agree (both voting)."
    return f'<section id="agreement"><h2>Member x member agreement</h2><p>{note}</p>{"".join(parts)}</section>'


PICTURE_KINDS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".gif": "gif", ".webp": "webp"}


def _embeddable(path: str | None) -> Path | None:
    """The sampled question's picture file when the page can hold it (a picture of at most MAX_PICTURE_BYTES)."""
    file = Path(path) if path else None
    if file is None or file.suffix.lower() not in PICTURE_KINDS or not file.is_file():
        return None
    return file if file.stat().st_size <= MAX_PICTURE_BYTES else None


def _picture_rule(file: Path, name: str) -> str:
    """A CSS class drawing `file`: each picture is in the page once, however many rows show it."""
    data = base64.b64encode(file.read_bytes()).decode()
    return f".{name} {{ background-image: url(data:image/{PICTURE_KINDS[file.suffix.lower()]};base64,{data}); }}\n"


def _text_cell(text: str, kind: str) -> str:
    """A prompt or response, cut at MAX_TEXT_CHARS with a note saying how much more there was."""
    shown, left = cut_text(text)
    note = f'<div class="muted">… {left:,} more characters (samples.jsonl holds them)</div>' if left else ""
    return f'<div class="text {kind}">{html.escape(shown)}</div>{note}'


def _completions(runs, names) -> tuple[str, str]:
    """The completions section and the CSS of its pictures. Rows are kept newest first up to MAX_COMPLETIONS
    rows and MAX_TABLE_BYTES of rows and pictures; each text is written once (a sort reads the cell's text)."""
    built, classes = _completion_rows(runs, names)
    if not built:
        return "", ""
    kept, rules = _newest_within_budget(built, classes)
    return _completions_section(kept, len(built) - len(kept)), "".join(rules.values())


def _completion_rows(runs, names) -> tuple[list[tuple], dict[Path, str]]:
    """Every response of every run's samples.jsonl as a table row: (row, its member label, its step, its picture
    file or None), oldest first; and each embeddable picture's CSS class."""
    built = []
    classes: dict[Path, str] = {}
    for i, run in enumerate(runs):
        for sample in read_jsonl(run.run_dir / "samples.jsonl"):
            file, picture = _embeddable(sample.get("image")), ""
            if file is not None:
                picture = f'<div class="pic {classes.setdefault(file, f"pic{len(classes)}")}"></div>'
            elif sample.get("image"):  # too large or not a picture: named
                picture = f'<div class="muted">{html.escape(Path(sample["image"]).name)}</div>'
            for mid, m in sample["members"].items():
                label = _label(names, i, mid)
                prompt = picture + _text_cell(m.get("prompt", sample["question"]), "prompt")
                source = ", ".join(m.get("label_from") or []) or "nobody"
                for k, text in enumerate(m["responses"]):
                    reward, advantage = m["rewards"][k], m["advantages"][k]
                    cells = [
                        (sample["step"], str(sample["step"])),
                        (None, html.escape(label)),
                        (None, prompt),
                        (None, _text_cell(text, "response")),
                        (None, html.escape(str(m["answers"][k]))),
                        (None, html.escape(str(m["vote"]))),
                        (str(m["label"]), f"{html.escape(str(m['label']))} <span class=\"muted\">from "
                                          f"{html.escape(source)}</span>"),
                        (reward, f"{reward:.3f}"),
                        (advantage, f"{advantage:+.3f}"),
                    ]  # fmt: skip
                    tds = "".join(
                        (f'<td data-v="{html.escape(str(v))}">' if v is not None else "<td>") + f"{shown}</td>"
                        for v, shown in cells
                    )
                    row = f'<tr data-member="{html.escape(label)}" data-step="{sample["step"]}">{tds}</tr>'
                    built.append((row, label, sample["step"], file))
    return built, classes


def _newest_within_budget(built: list[tuple], classes: dict[Path, str]) -> tuple[list[tuple], dict[Path, str]]:
    """The newest rows of `built` up to MAX_COMPLETIONS rows and MAX_TABLE_BYTES of rows and pictures, in their
    order, as (row, label, step); and the CSS rule of each picture they show."""
    kept, rules, size = [], {}, 0
    for row, label, step, file in reversed(built):
        rule = "" if file is None or file in rules else _picture_rule(file, classes[file])
        cost = len(row.encode()) + len(rule.encode())
        if len(kept) == MAX_COMPLETIONS or size + cost > MAX_TABLE_BYTES:
            break
        kept.append((row, label, step))
        size += cost
        if rule:
            rules[file] = rule
    kept.reverse()
    return kept, rules


def _completions_section(kept: list[tuple], dropped: int) -> str:
    """The completions table of the `kept` rows with its member and step filters and a note of the `dropped`."""
    options = lambda values: "".join(  # noqa: E731
        f'<option value="{html.escape(str(v))}">{html.escape(str(v))}</option>' for v in values
    )
    heads = ["step", "member", "prompt", "response", "answer", "vote", "label (source)", "reward", "advantage"]
    numeric = {"step", "reward", "advantage"}
    header = "".join(
        f'<th data-col="{j}" data-numeric="{int(h in numeric)}" title="click to sort">{h}</th>'
        for j, h in enumerate(heads)
    )
    more = (
        f" The oldest {dropped} rows are left out (the table holds at most {MAX_COMPLETIONS:,} rows and "
        f"{MAX_TABLE_BYTES / 1e6:g} MB; samples.jsonl has them all)."
        if dropped
        else ""
    )
    section = (
        '<section id="completions"><h2>Completions</h2>'
        f"<p>Every response of the sampled questions (logging.samples_every): one row per response.{more} "
        f"A prompt or response longer than {MAX_TEXT_CHARS:,} characters is cut. "
        'Click a column to sort; filter by member and step.</p><div class="filters">'
        f'<label>member <select id="member-filter"><option value="">all</option>'
        f"{options(sorted({label for _, label, _ in kept}))}</select></label> "
        f'<label>step <select id="step-filter"><option value="">all</option>'
        f"{options(sorted({step for _, _, step in kept}))}</select>"
        '</label> <span id="shown"></span></div>'
        f'<table class="grid" id="completions-table"><thead><tr>{header}</tr></thead><tbody>'
        f"{''.join(row for row, _, _ in kept)}</tbody></table></section>"
    )
    return section


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
.plot svg { max-width: 100%; height: auto; }
table.grid { border-collapse: collapse; margin: .5em 0; }
table.grid td, table.grid th { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top; text-align: left; }
table.grid th { background: #f3f3f3; }
#completions-table th { cursor: pointer; position: sticky; top: 0; }
.matrix td { text-align: center; min-width: 3.5em; }
.text { white-space: pre-wrap; max-width: 32em; font-family: ui-monospace, monospace; font-size: 12px; }
.response { max-width: 30em; }
.prompt { min-width: 18em; }  /* else the table squeezes a long instruction to a word per line */
.muted { color: #777; font-size: 12px; }
.pic { image-rendering: pixelated; width: 64px; height: 64px; background: no-repeat center / contain; }
.filters { margin: .5em 0; } #shown { color: #555; margin-left: 1em; }
"""

# Filters and sorting over the rows the page already holds: nothing is fetched, no text is parsed as HTML.
SCRIPT = """
function applyFilters() {
  const member = document.getElementById('member-filter').value;
  const step = document.getElementById('step-filter').value;
  let shown = 0, total = 0;
  for (const tr of document.querySelectorAll('#completions-table tbody tr')) {
    const ok = (!member || tr.dataset.member === member) && (!step || tr.dataset.step === step);
    tr.hidden = !ok; total += 1; if (ok) shown += 1;
  }
  document.getElementById('shown').textContent = shown + ' of ' + total + ' rows';
  return shown;
}
function setFilter(name, value) {
  document.getElementById(name + '-filter').value = value;
  return applyFilters();
}
function sortBy(col, numeric, descending) {
  const body = document.querySelector('#completions-table tbody');
  const rows = Array.from(body.rows);
  const key = tr => {  // a text is in the page once: sorting reads the cell's text, its data-v where it has one
    const cell = tr.cells[col];
    return cell.dataset.v ?? (cell.querySelector('.text') || cell).textContent;
  };
  rows.sort((a, b) => {
    const x = numeric ? parseFloat(key(a)) : key(a), y = numeric ? parseFloat(key(b)) : key(b);
    return (x < y ? -1 : x > y ? 1 : 0) * (descending ? -1 : 1);
  });
  for (const tr of rows) body.appendChild(tr);
}
function fromAddress() {
  const params = new URLSearchParams(location.hash.slice(1));
  for (const name of ['member', 'step']) {
    const select = document.getElementById(name + '-filter');
    if (select && params.has(name)) select.value = params.get(name);
  }
}
document.addEventListener('DOMContentLoaded', () => {
  const table = document.getElementById('completions-table');
  if (!table) return;
  for (const th of table.tHead.rows[0].cells) {
    th.addEventListener('click', () => {
      const descending = th.dataset.sorted === 'asc';
      for (const other of table.tHead.rows[0].cells) delete other.dataset.sorted;
      th.dataset.sorted = descending ? 'desc' : 'asc';
      sortBy(Number(th.dataset.col), th.dataset.numeric === '1', descending);
    });
  }
  for (const name of ['member', 'step']) {
    document.getElementById(name + '-filter').addEventListener('change', applyFilters);
  }
  fromAddress();
  applyFilters();
});
window.addEventListener('hashchange', () => { fromAddress(); applyFilters(); });
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{style}</style></head>
<body><h1>{title}</h1>
{body}
<script>{script}</script>
</body></html>
"""

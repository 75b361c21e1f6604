"""Collapse detector: pure functions over the history of metrics rows (one row per slot per step).

The signature of a cohort that converges on a wrong consensus is: its answers become less diverse while its
members agree more, and (when gold answers exist for diagnostics) its pseudo-labels become less accurate.
Healthy training also sharpens answers and raises agreement, which is why pseudo-label accuracy, when it is
logged, must fall too before anything is flagged.

Window rule (per slot, over its rows ordered by step; T = the number of its rows so far):
    w = max(rule.min_window, ceil(rule.window_frac * T)); nothing is evaluated while T < 2 * w
    (with the defaults, before 10 steps), so the early window (first w rows) and the recent window
    (last w rows) never overlap. Each number below is the mean of a key over a window, None values skipped.

A slot is flagged at its T-th row when ALL of:
    1. diversity falls: `answer_entropy_batch` (entropy of all the slot's answers of the step, nats) has
       early > 0 and (early - late) / early >= rule.min_diversity_drop (default 0.3) and
       early - late >= rule.min_diversity_drop_abs (default 0.05 nats);
    2. agreement rises: late - early >= rule.min_agreement_rise (default 0.10) for `agreement` (share of the
       slot's responses that match its pseudo-label) OR for `unanimous_rate` (share of questions on which every
       slot votes the same answer), whichever rises more;
    3. only where `pseudo_label_acc` has values in both windows: early - late >= rule.min_pseudo_label_drop
       (default 0.05). Without gold diagnostics the rule is 1 and 2 alone.
A key missing from either window makes its condition unevaluable, and nothing is flagged.

Inside categories (rows with `category_stats`, monitor/category_metrics.py), over the same two windows, with
each window's numbers pooled over its rows (sums over counts; answers pooled across the window's questions, so
a member that is sure of each answer still shows the category's spread of answers):
    trend rule: 1-3 above, on the category's pooled answer entropy, agreement, unanimity and pseudo-label
       accuracy (the batch can look healthy while one category collapses: yes/no questions 74 % of the batch,
       their pseudo-labels improving, hide a colour category sliding onto one wrong answer);
    one-answer rule (needs no gold): the late window's answers to the category are ONE answer (at least
       rule.min_pooled_answers of them, default 8), its agreement is >= rule.one_answer_agreement (default
       0.95), and the early window's answers were diverse (pooled entropy >= rule.min_early_entropy, default
       0.3 nats). A category whose gold answer is always the same, learnt from diverse mistakes, is flagged
       too: a false alarm this rule accepts.

`flag_step` sets `collapse_flag` (1 flagged, 0 evaluated and not flagged, None too few steps) and `collapse_on`
(what was flagged: "batch" and/or category names) on the rows of a new step and logs one warning per slot and
category, the first time; `collapse_warnings` gives, for a whole history, each slot's first detection (batch
and per category) with its evidence (what summary.json keeps under `collapse_warnings`). `eval_drops` flags a
member whose in-loop evaluation accuracy on a category fell more than `eval.max_category_drop` below its
step-0 value, by at least EVAL_DROP_Z standard errors (a small evaluation set's noise is not a collapse).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vlm_corl.training.monitor.category_metrics import pooled, pooled_diversity, ratio

log = logging.getLogger("vlm_corl")

DIVERSITY_KEY = "answer_entropy_batch"
AGREEMENT_KEYS = ("agreement", "unanimous_rate")
GOLD_KEY = "pseudo_label_acc"
EVIDENCE_KEYS = (DIVERSITY_KEY, "answer_entropy", "distinct_answers", *AGREEMENT_KEYS, GOLD_KEY)


@dataclass(frozen=True)
class CollapseRule:
    """Thresholds of the detector (see the module docstring for how they are used)."""

    window_frac: float = 0.2
    min_window: int = 5
    max_window: int = 50
    min_diversity_drop: float = 0.3  # relative fall of answer_entropy_batch
    min_diversity_drop_abs: float = 0.05  # nats
    min_agreement_rise: float = 0.10  # absolute rise of agreement or unanimous_rate
    min_pseudo_label_drop: float = 0.05  # absolute fall of pseudo_label_acc, when logged
    one_answer_agreement: float = 0.95  # one-answer rule: late agreement at least this
    min_early_entropy: float = 0.3  # one-answer rule: the early window's pooled answer entropy (nats)
    min_pooled_answers: int = 8  # one-answer rule: answers in the late window


DEFAULT_RULE = CollapseRule()


def window_size(n_rows: int, rule: CollapseRule = DEFAULT_RULE) -> int | None:
    """The size w of the early and the recent window for a slot with `n_rows` rows; None while 2w > n_rows."""
    w = max(rule.min_window, min(rule.max_window, math.ceil(rule.window_frac * n_rows)), 1)
    return w if 2 * w <= n_rows else None


def slot_histories(history: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by slot ("member" key), each slot's rows ordered by step (a repeated step: the last row wins)."""
    by_slot: dict[str, dict[int, dict]] = {}
    for row in history:
        by_slot.setdefault(row["member"], {})[row["step"]] = row
    return {slot: [rows[s] for s in sorted(rows)] for slot, rows in by_slot.items()}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def window_mean(rows: list[dict] | _Ends, key: str, start: int, stop: int) -> float | None:
    """Mean of `key` over rows[start:stop] (a list, or `_Ends`), None values skipped; None when there are none."""
    values = [float(v) for i in range(start, stop) if _number(v := rows[i].get(key))]
    return sum(values) / len(values) if values else None


def _evidence(rows, n: int, rule: CollapseRule) -> dict | None:
    """The detector on the first n rows of a slot (a list, or `_Ends`): window means and whether the slot is
    flagged; None while there are too few rows."""
    w = window_size(n, rule)
    if w is None:
        return None
    ev: dict = {
        "step": rows[n - 1]["step"],
        "early_steps": [rows[0]["step"], rows[w - 1]["step"]],
        "late_steps": [rows[n - w]["step"], rows[n - 1]["step"]],
    }
    means = {key: (window_mean(rows, key, 0, w), window_mean(rows, key, n - w, n)) for key in EVIDENCE_KEYS}
    for key, (early, late) in means.items():
        ev[f"{key}_early"] = None if early is None else round(early, 4)
        ev[f"{key}_late"] = None if late is None else round(late, 4)
    ev["uses_pseudo_label_acc"] = None not in means[GOLD_KEY]
    ev["flagged"] = trend_flagged(means[DIVERSITY_KEY], [means[key] for key in AGREEMENT_KEYS], means[GOLD_KEY], rule)
    return ev


def trend_flagged(
    diversity: tuple[float | None, float | None],
    agreements: Sequence[tuple[float | None, float | None]],
    gold: tuple[float | None, float | None],
    rule: CollapseRule = DEFAULT_RULE,
) -> bool:
    """Conditions 1-3 of the window rule on (early, late) pairs: diversity, each agreement measure, and
    pseudo-label accuracy (a pair with a None is unevaluable: no diversity or agreement, or no gold)."""
    d_early, d_late = diversity
    diversity_falls = (
        d_early is not None
        and d_late is not None
        and d_early > 0
        and (d_early - d_late) / d_early >= rule.min_diversity_drop
        and d_early - d_late >= rule.min_diversity_drop_abs
    )
    rises = [late - early for early, late in agreements if early is not None and late is not None]
    agreement_rises = bool(rises) and max(rises) >= rule.min_agreement_rise
    g_early, g_late = gold
    gold_falls = g_early is None or g_late is None or g_early - g_late >= rule.min_pseudo_label_drop
    return diversity_falls and agreement_rises and gold_falls


def category_evidence(rows: list[dict] | _Ends, n: int, rule: CollapseRule = DEFAULT_RULE) -> list[dict]:
    """The per-category rules (module docstring) on the first n rows of one slot (a list, or `_Ends`): one
    evidence dict per flagged category, with the rule that fired ("one_answer" first, else "trend")."""
    w = window_size(n, rule)
    if w is None:
        return []
    early = pooled(rows[i].get("category_stats") for i in range(w))
    late = pooled(rows[i].get("category_stats") for i in range(n - w, n))
    found = []
    for category in sorted(set(early) & set(late)):
        e, late_c = early[category], late[category]
        (h_early, _), (h_late, distinct_late) = pooled_diversity(e["answers"]), pooled_diversity(late_c["answers"])
        pairs = {key: (ratio(e[key]), ratio(late_c[key])) for key in ("agreement", "unanimous", "pseudo_label_acc")}
        one_answer = (
            distinct_late == 1
            and sum(late_c["answers"].values()) >= rule.min_pooled_answers
            and (pairs["agreement"][1] or 0.0) >= rule.one_answer_agreement
            and (h_early or 0.0) >= rule.min_early_entropy
        )
        trend = trend_flagged(
            (h_early, h_late), [pairs["agreement"], pairs["unanimous"]], pairs["pseudo_label_acc"], rule
        )
        if not (one_answer or trend):
            continue
        ev = {
            "category": category,
            "rule": "one_answer" if one_answer else "trend",
            "step": rows[n - 1]["step"],
            "early_steps": [rows[0]["step"], rows[w - 1]["step"]],
            "late_steps": [rows[n - w]["step"], rows[n - 1]["step"]],
            "answer_entropy_early": _round(h_early),
            "answer_entropy_late": _round(h_late),
            "distinct_late": distinct_late,
            "top_answer_late": max(late_c["answers"], key=late_c["answers"].get, default=None),
        }
        for key, (a, b) in pairs.items():
            ev[f"{key}_early"], ev[f"{key}_late"] = _round(a), _round(b)
        found.append(ev)
    return found


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def collapse_evidence(rows: list[dict], rule: CollapseRule = DEFAULT_RULE) -> dict | None:
    """The detector on ONE slot's rows (ordered by step) as they stand: evidence dict with "flagged", or None.
    Reads only the two windows (O(w))."""
    return _evidence(rows, len(rows), rule) if rows else None


def collapse_warnings(history: list[dict], rule: CollapseRule = DEFAULT_RULE) -> list[dict]:
    """Each slot's FIRST detection over the history, for the batch and for each category: [{slot, step,
    category (None: the batch), evidence numbers...}], in slot order, the batch's first.

    Evaluates the rules after every row of each slot, as the training loop does (O(T w) per slot)."""
    warnings = []
    for slot, rows in slot_histories(history).items():
        for n in range(1, len(rows) + 1):
            ev = _evidence(rows, n, rule)
            if ev is not None and ev["flagged"]:
                warnings.append({"slot": slot, "category": None, **{k: v for k, v in ev.items() if k != "flagged"}})
                break
        seen = set()
        for n in range(1, len(rows) + 1):
            for ev in category_evidence(rows, n, rule):
                if ev["category"] not in seen:
                    seen.add(ev["category"])
                    warnings.append({"slot": slot, **ev})
    return warnings


def flag_step(history: list[dict], rows: list[dict], rule: CollapseRule = DEFAULT_RULE) -> list[dict]:
    """Check one new step: set `collapse_flag` and `collapse_on` on each of `rows` (this step's rows, not yet in
    `history`, which holds the earlier rows in step order) from the detector over history + rows, and log a
    warning for each slot and category flagged for the first time (not in an earlier row's `collapse_on`).
    Returns the warnings logged now ({slot, step, category (None: the batch), evidence}). Cost: one pass over
    `history` plus the two windows (a run keeps a `CollapseTracker` instead, which needs no pass)."""
    tracker = CollapseTracker(rule)
    for row in history:  # one pass; the loop appends rows in step order
        if any(r["member"] == row["member"] for r in rows):
            tracker.add(row)
    return tracker.flag(rows)


class CollapseTracker:
    """The detector over a whole run without keeping its rows: each slot's first and last rows (all its windows
    read, `_Ends`), what each slot was flagged on already, the first detections (summary.json's
    `collapse_warnings`), each slot's latest row and its last `recent` rows (the per-category running means).
    Memory and time per step stay flat however long the run is."""

    def __init__(self, rule: CollapseRule = DEFAULT_RULE, recent: int = 0):
        self.rule, self.keep, self.recent_n = rule, max(rule.max_window, rule.min_window), recent
        self.ends: dict[str, _Ends] = {}
        self.flagged: set[tuple[str, str]] = set()
        self.first: list[dict] = []  # first detections, in the order they were found
        self.latest: dict[str, dict] = {}
        self.recent: dict[str, deque] = {}

    def add(self, row: dict) -> None:
        """Record an earlier row (already flagged), in step order."""
        slot = row["member"]
        self.ends.setdefault(slot, _Ends(self.keep)).add(row)
        self._note(row)

    def _note(self, row: dict) -> None:
        slot = row["member"]
        self.flagged.update((slot, what) for what in _flagged_on(row))
        self.latest[slot] = row
        self.recent.setdefault(slot, deque(maxlen=self.recent_n)).append(row)

    def restore(self, rows: list[dict]) -> None:
        """A resumed run's rows so far (metrics.jsonl up to its checkpoint): the state as if flagged here."""
        for row in rows:
            self.add(row)
        self.first = collapse_warnings(rows, self.rule)

    def warnings(self) -> list[dict]:
        """The first detections in `collapse_warnings`' order: by slot, the batch's first."""
        order = {slot: i for i, slot in enumerate(self.latest)}
        return sorted(self.first, key=lambda w: (order.get(w["slot"], len(order)), w["category"] is not None))

    def flag(self, rows: list[dict]) -> list[dict]:
        """`flag_step` for this step's `rows` against the run so far; the rows become part of it."""
        new = []
        for row in rows:
            mine = self.ends.setdefault(row["member"], _Ends(self.keep))
            mine.add(row)
            ev = _evidence(mine, mine.n, self.rule)
            found = (
                [{"category": None, **{k: v for k, v in ev.items() if k != "flagged"}}] if ev and ev["flagged"] else []
            ) + category_evidence(mine, mine.n, self.rule)
            row["collapse_flag"] = None if ev is None else int(bool(found))
            row["collapse_on"] = [BATCH if f["category"] is None else f["category"] for f in found]
            for f in found:
                if (row["member"], BATCH if f["category"] is None else f["category"]) not in self.flagged:
                    warning = {"slot": row["member"], **f}
                    log.warning(
                        "possible collapse of %s%s at step %s: %s",
                        row["member"],
                        f" in category {f['category']!r}" if f["category"] is not None else "",
                        row["step"],
                        describe(warning),
                    )
                    new.append(warning)
        for row in rows:
            self._note(row)
        self.first += new
        return new


BATCH = "batch"  # `collapse_on` entry of the batch-level rule


def _flagged_on(row: dict) -> list[str]:
    """What a row was flagged on (rows written before `collapse_on` existed: the batch, when flagged)."""
    if "collapse_on" in row:
        return row["collapse_on"] or []
    return [BATCH] if row.get("collapse_flag") == 1 else []


class _Ends:
    """A slot's rows as the detector reads them: only the first and the last `keep` rows are held (windows are
    never longer), indexed as in the full list of `n` rows."""

    def __init__(self, keep: int):
        self.keep, self.n, self.first, self.last = keep, 0, [], deque(maxlen=keep)

    def add(self, row: dict) -> None:
        if len(self.first) < self.keep:
            self.first.append(row)
        self.last.append(row)
        self.n += 1

    def __getitem__(self, i: int) -> dict:
        return self.first[i] if i < len(self.first) else self.last[i - (self.n - len(self.last))]


def describe(warning: dict) -> str:
    """One line for a warning: how diversity, agreement and pseudo-label accuracy moved between the windows, or
    how an evaluated category fell."""
    if warning.get("rule") == "eval_drop":
        return (
            f"{warning['benchmark']} accuracy on {warning['category']!r} fell from {warning['accuracy_step0']:.3f} "
            f"at step 0 to {warning['accuracy']:.3f} at step {warning['step']} (more than "
            f"eval.max_category_drop={warning['max_drop']}, {warning['z']} standard errors)"
        )

    def move(key: str) -> str | None:
        early, late = warning.get(f"{key}_early"), warning.get(f"{key}_late")
        return None if early is None or late is None else f"{key} {early:.3f} -> {late:.3f}"

    keys = (
        (DIVERSITY_KEY, *AGREEMENT_KEYS, GOLD_KEY)
        if warning.get("category") is None
        else ("answer_entropy", "agreement", "unanimous", "pseudo_label_acc")
    )
    parts = [m for key in keys if (m := move(key))]
    early, late = warning["early_steps"], warning["late_steps"]
    what = (
        f"its answers are all one answer, {warning['top_answer_late']!r}, while agreement is high"
        if warning.get("rule") == "one_answer"
        else "diversity falls while agreement rises"
    )
    return f"{what} (steps {early[0]}-{early[1]} vs {late[0]}-{late[1]}: " + ", ".join(parts) + ")"


EVAL_DROP_Z = 2.0  # a fall must also be this many standard errors: not the noise of a small evaluation set


def eval_drops(eval_rows: list[dict], max_drop: float, z: float = EVAL_DROP_Z) -> list[dict]:
    """Each (member, benchmark, category)'s first in-loop evaluation whose accuracy is more than `max_drop` below
    the step-0 evaluation's, in row order: [{slot, step, category, rule: "eval_drop", benchmark, accuracy_step0,
    accuracy, max_drop, z}]. Categories are the rows' `accuracy_<category>` keys, with their question counts
    `n_<category>`; no step-0 row, no flag. The fall must also be significant: at least `z` standard errors of
    the difference of the two proportions (pooled), so 8/10 -> 6/10 (z = 1.0) is noise while 13/20 -> 0/20
    (z = 4.4) is not."""
    base: dict[tuple[str, str], dict] = {}
    found, seen = [], set()
    for row in sorted(eval_rows, key=lambda r: r["step"]):
        key = (row["member"], row["benchmark"])
        if row["step"] == 0:
            base[key] = row
            continue
        for name, value in row.items():
            if not name.startswith("accuracy_") or key not in base or base[key].get(name) is None:
                continue
            category, start = name[len("accuracy_") :], base[key][name]
            n0, n1 = base[key].get(f"n_{category}"), row.get(f"n_{category}")
            score = _drop_z(start, value, n0, n1)
            if start - value > max_drop and score >= z and (*key, category) not in seen:
                seen.add((*key, category))
                found.append(
                    {
                        "slot": row["member"],
                        "step": row["step"],
                        "category": category,
                        "rule": "eval_drop",
                        "benchmark": row["benchmark"],
                        "accuracy_step0": start,
                        "accuracy": value,
                        "max_drop": max_drop,
                        "z": round(score, 2),
                    }
                )
    return found


def _drop_z(p0: float, p1: float, n0: int | None, n1: int | None) -> float:
    """The fall p0 -> p1 in pooled standard errors of two proportions over n0 and n1 questions (inf when the
    counts are unknown or the pooled proportion is 0 or 1)."""
    if not n0 or not n1:
        return math.inf
    pooled_p = (p0 * n0 + p1 * n1) / (n0 + n1)
    se = math.sqrt(pooled_p * (1 - pooled_p) * (1 / n0 + 1 / n1))
    return (p0 - p1) / se if se > 0 else math.inf

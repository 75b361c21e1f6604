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

`flag_step` sets `collapse_flag` (1 flagged, 0 evaluated and not flagged, None too few steps) on the rows of a
new step and logs one warning per slot, the first time the slot is flagged; `collapse_warnings` gives, for a whole
history, each slot's first detection with its evidence (what summary.json keeps under `collapse_warnings`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from itertools import accumulate

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


class _Prefix:
    """Prefix sums of one key over a slot's rows: the mean over any row range in O(1), None values skipped."""

    def __init__(self, rows: list[dict], key: str):
        values = [row.get(key) for row in rows]
        self.sums = [0.0, *accumulate(float(v) if _number(v) else 0.0 for v in values)]
        self.counts = [0, *accumulate(1 if _number(v) else 0 for v in values)]

    def mean(self, start: int, stop: int) -> float | None:
        n = self.counts[stop] - self.counts[start]
        return (self.sums[stop] - self.sums[start]) / n if n else None


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _direct_mean(rows: list[dict], key: str, start: int, stop: int) -> float | None:
    values = [float(v) for row in rows[start:stop] if _number(v := row.get(key))]
    return sum(values) / len(values) if values else None


def _evidence(rows: list[dict], n: int, rule: CollapseRule, mean) -> dict | None:
    """The detector on the first n rows of a slot, `mean(key, start, stop)` averaging a key over rows[start:stop]:
    window means and whether the slot is flagged; None while there are too few rows."""
    w = window_size(n, rule)
    if w is None:
        return None
    ev: dict = {"step": rows[n - 1]["step"], "early_steps": [rows[0]["step"], rows[w - 1]["step"]],
                "late_steps": [rows[n - w]["step"], rows[n - 1]["step"]]}
    means = {key: (mean(key, 0, w), mean(key, n - w, n)) for key in EVIDENCE_KEYS}
    for key, (early, late) in means.items():
        ev[f"{key}_early"] = None if early is None else round(early, 4)
        ev[f"{key}_late"] = None if late is None else round(late, 4)
    d_early, d_late = means[DIVERSITY_KEY]
    diversity_falls = (d_early is not None and d_late is not None and d_early > 0
                       and (d_early - d_late) / d_early >= rule.min_diversity_drop
                       and d_early - d_late >= rule.min_diversity_drop_abs)
    rises = [late - early for key in AGREEMENT_KEYS if None not in (early := means[key][0], late := means[key][1])]
    agreement_rises = bool(rises) and max(rises) >= rule.min_agreement_rise
    g_early, g_late = means[GOLD_KEY]
    has_gold = g_early is not None and g_late is not None
    ev["uses_pseudo_label_acc"] = has_gold
    gold_falls = not has_gold or g_early - g_late >= rule.min_pseudo_label_drop
    ev["flagged"] = diversity_falls and agreement_rises and gold_falls
    return ev


def collapse_evidence(rows: list[dict], rule: CollapseRule = DEFAULT_RULE) -> dict | None:
    """The detector on ONE slot's rows (ordered by step) as they stand: evidence dict with "flagged", or None.
    Reads only the two windows (O(w))."""
    return _evidence(rows, len(rows), rule, lambda key, a, b: _direct_mean(rows, key, a, b)) if rows else None


def collapse_warnings(history: list[dict], rule: CollapseRule = DEFAULT_RULE) -> list[dict]:
    """Each slot's FIRST detection over the history: [{slot, step, evidence numbers...}], in slot order.

    Evaluates the rule after every row of each slot, as the training loop does (O(T) per slot with prefix sums).
    """
    warnings = []
    for slot, rows in slot_histories(history).items():
        prefixes = {key: _Prefix(rows, key) for key in EVIDENCE_KEYS}
        for n in range(1, len(rows) + 1):
            ev = _evidence(rows, n, rule, lambda key, a, b: prefixes[key].mean(a, b))
            if ev is not None and ev["flagged"]:
                warnings.append({"slot": slot, **{k: v for k, v in ev.items() if k != "flagged"}})
                break
    return warnings


def flag_step(history: list[dict], rows: list[dict], rule: CollapseRule = DEFAULT_RULE) -> list[dict]:
    """Check one new step: set `collapse_flag` on each of `rows` (this step's rows, not yet in `history`, which
    holds the earlier rows in step order) from the detector over history + rows, and log a warning for each slot
    flagged for the first time (no earlier row of the slot in `history` has collapse_flag 1). Returns the warnings
    logged now ({slot, step, evidence}). Cost: one pass over `history` plus the two windows."""
    ends = {row["member"]: _Ends(max(rule.max_window, rule.min_window)) for row in rows}
    flagged_before = set()
    for row in history:  # one pass; the loop appends rows in step order
        mine = ends.get(row["member"])
        if mine is not None:
            mine.add(row)
            if row.get("collapse_flag") == 1:
                flagged_before.add(row["member"])
    new = []
    for row in rows:
        mine = ends[row["member"]]
        mine.add(row)
        ev = _evidence(mine, mine.n, rule, mine.mean)
        row["collapse_flag"] = None if ev is None else int(ev["flagged"])
        if row["collapse_flag"] and row["member"] not in flagged_before:
            warning = {"slot": row["member"], **{k: v for k, v in ev.items() if k != "flagged"}}
            log.warning("possible collapse of %s at step %s: %s", row["member"], row["step"], describe(warning))
            new.append(warning)
    return new


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

    def mean(self, key: str, start: int, stop: int) -> float | None:
        values = [float(v) for i in range(start, stop) if _number(v := self[i].get(key))]
        return sum(values) / len(values) if values else None


def describe(warning: dict) -> str:
    """One line for a warning: how diversity, agreement and pseudo-label accuracy moved between the windows."""

    def move(key: str) -> str | None:
        early, late = warning.get(f"{key}_early"), warning.get(f"{key}_late")
        return None if early is None or late is None else f"{key} {early:.3f} -> {late:.3f}"

    parts = [m for key in (DIVERSITY_KEY, *AGREEMENT_KEYS, GOLD_KEY) if (m := move(key))]
    early, late = warning["early_steps"], warning["late_steps"]
    return (f"diversity falls while agreement rises (steps {early[0]}-{early[1]} vs {late[0]}-{late[1]}: "
            + ", ".join(parts) + ")")

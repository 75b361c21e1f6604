"""Pairwise agreement of two members' evaluation records (pure functions, labels used as the probe's diagnostic
only): Cohen's κ on correctness, complementarity, p_A + p_B and its standard error, the shared-wrong-answer
rates, per question type; every pair of a set of models ranked by `RULE`, and the recommendation. The probe
command (`vlm_corl.commands.probe`) and the label-headroom analysis (`training/rewards/headroom.py`) both read them."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

from vlm_corl.data.answers import answers_equivalent

RULE = (
    "Pairs are ranked by: (1) p_A + p_B > 1 overall first (a ring of two converges to the right answer when "
    "p_A + p_B > 1, to a wrong consensus when < 1); (2) lower Cohen's kappa on correctness (less correlated "
    "errors; an undefined kappa ranks last); (3) higher complementarity (share exactly one gets right); "
    "(4) higher p_A + p_B. The best pair is the first. A question type on which a pair has p_A + p_B < 1 is "
    "flagged: expect collapse to a wrong consensus on this type."
)
COLLAPSE_WARNING = "expect collapse to a wrong consensus on this type"

# ---------------------------------------------------------------------------------------------------------
# Pure maths on correctness vectors (length n, one entry per question, same question order in both).


def _check_pair(a: Sequence, b: Sequence) -> int:
    if len(a) != len(b):
        raise ValueError(f"vectors of different lengths: {len(a)} and {len(b)}")
    return len(a)


def cohen_kappa(a: Sequence[bool], b: Sequence[bool]) -> float | None:
    """Cohen's κ between two correctness vectors of length n: (p_o − p_e) / (1 − p_e).

    p_o is the observed agreement (both right or both wrong), p_e = p_A·p_B + (1 − p_A)(1 − p_B) the agreement
    expected if the two were independent with the same accuracies. Computed on integer counts, so exact.

    Degenerate case: p_e = 1 happens only when both vectors are constant and equal (both models right on every
    question, or both wrong on every question); then p_o = 1 too and κ = 0/0 is undefined: returns None
    (there is no variation in correctness to correlate). Also None for n = 0.
    """
    n = _check_pair(a, b)
    if n == 0:
        return None
    ca, cb = sum(map(bool, a)), sum(map(bool, b))
    agree = sum(bool(x) == bool(y) for x, y in zip(a, b))
    expected = ca * cb + (n - ca) * (n - cb)  # n² · p_e
    if expected == n * n:
        return None
    return (agree * n - expected) / (n * n - expected)


def complementarity(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Share of the n questions that exactly one of the two gets right (0.0 for n = 0)."""
    n = _check_pair(a, b)
    return sum(bool(x) != bool(y) for x, y in zip(a, b)) / n if n else 0.0


def accuracy_sum(a: Sequence[bool], b: Sequence[bool]) -> float:
    """p_A + p_B, the sum of the two accuracies (0.0 for n = 0)."""
    n = _check_pair(a, b)
    return (sum(map(bool, a)) + sum(map(bool, b))) / n if n else 0.0


def accuracy_sum_se(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Standard error of p_A + p_B over the questions: std(c_A + c_B) / √n (population std; counts the
    covariance of the two members' errors). 0.0 for n < 2."""
    n = _check_pair(a, b)
    if n < 2:
        return 0.0
    s = [int(bool(x)) + int(bool(y)) for x, y in zip(a, b)]
    mean = sum(s) / n
    return math.sqrt(sum((v - mean) ** 2 for v in s) / n / n)


def both_wrong_rate(a: Sequence[bool], b: Sequence[bool]) -> float:
    """Share of the n questions both get wrong (0.0 for n = 0)."""
    n = _check_pair(a, b)
    return sum(not x and not y for x, y in zip(a, b)) / n if n else 0.0


def same_wrong_rate(
    a_correct: Sequence[bool], b_correct: Sequence[bool], a_pred: Sequence[str | None], b_pred: Sequence[str | None]
) -> float:
    """Share of the n questions both get wrong with the same answer (answers compared by
    `answers_equivalent`). A missing answer (None, unparseable) never matches: two models that both fail
    to answer abstain in a vote, they do not agree on a wrong label. 0.0 for n = 0."""
    n = _check_pair(a_correct, b_correct)
    _check_pair(a_correct, a_pred)
    _check_pair(a_correct, b_pred)
    hits = sum(
        not ca and not cb and answers_equivalent(pa, pb) for ca, cb, pa, pb in zip(a_correct, b_correct, a_pred, b_pred)
    )
    return hits / n if n else 0.0


def pair_metrics(
    a_correct: Sequence[bool], b_correct: Sequence[bool], a_pred: Sequence[str | None], b_pred: Sequence[str | None]
) -> dict:
    """Every pairwise number on one set of n questions: {"n", "kappa", "complementarity", "acc_sum",
    "acc_sum_se", "both_wrong", "same_wrong"}."""
    return {
        "n": _check_pair(a_correct, b_correct),
        "kappa": cohen_kappa(a_correct, b_correct),
        "complementarity": complementarity(a_correct, b_correct),
        "acc_sum": accuracy_sum(a_correct, b_correct),
        "acc_sum_se": accuracy_sum_se(a_correct, b_correct),
        "both_wrong": both_wrong_rate(a_correct, b_correct),
        "same_wrong": same_wrong_rate(a_correct, b_correct, a_pred, b_pred),
    }


# ---------------------------------------------------------------------------------------------------------
# From evaluation records (`vlm_corl.eval`: [{"id", "type", "pred", "gold", "correct", ...}]) to a report.


def _aligned(records_a: Sequence[Mapping], records_b: Sequence[Mapping]) -> list[tuple[Mapping, Mapping]]:
    """The two models' records paired by question id, in A's order; both must cover the same questions."""
    by_id = {r["id"]: r for r in records_b}
    ids_a = [r["id"] for r in records_a]
    if set(ids_a) != set(by_id) or len(ids_a) != len(records_b):
        raise ValueError("the two models were evaluated on different questions (ids differ)")
    return [(r, by_id[r["id"]]) for r in records_a]


def pair_report(records_a: Sequence[Mapping], records_b: Sequence[Mapping]) -> dict:
    """`pair_metrics` of two models overall and per question type (records' "type"; types that are None are
    counted overall only), plus the types flagged for collapse (p_A + p_B < 1).

    Returns {"overall": metrics, "by_type": {type: metrics}, "collapse_types": [type, ...]}.
    """
    pairs = _aligned(records_a, records_b)
    groups: dict[str, list[tuple[Mapping, Mapping]]] = defaultdict(list)
    for ra, rb in pairs:
        if ra.get("type") is not None:
            groups[str(ra["type"])].append((ra, rb))

    def metrics(ps: list[tuple[Mapping, Mapping]]) -> dict:
        return pair_metrics(
            [bool(ra["correct"]) for ra, _ in ps],
            [bool(rb["correct"]) for _, rb in ps],
            [ra.get("pred") for ra, _ in ps],
            [rb.get("pred") for _, rb in ps],
        )

    by_type = {t: metrics(ps) for t, ps in sorted(groups.items())}
    return {
        "overall": metrics(pairs),
        "by_type": by_type,
        "collapse_types": [t for t, m in by_type.items() if m["acc_sum"] < 1],
    }


def model_summary(records: Sequence[Mapping]) -> dict:
    """{"n", "accuracy", "by_type"} of one model's records."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        if r.get("type") is not None:
            groups[str(r["type"])].append(bool(r["correct"]))
    n = len(records)
    return {
        "n": n,
        "accuracy": sum(bool(r["correct"]) for r in records) / n if n else 0.0,
        "by_type": {t: sum(c) / len(c) for t, c in sorted(groups.items())},
    }


def rank_key(pair: Mapping) -> tuple:
    """Sort key implementing RULE on a pair's overall metrics (smaller sorts first)."""
    m = pair["overall"]
    return (
        not m["acc_sum"] > 1,
        m["kappa"] is None,
        m["kappa"] if m["kappa"] is not None else 0.0,
        -m["complementarity"],
        -m["acc_sum"],
    )


def probe(models: Mapping[str, Sequence[Mapping]]) -> dict:
    """The whole probe from each model's evaluation records ({name: records}, at least two models, all on
    the same questions).

    Returns {"rule", "models": {name: model_summary}, "pairs": [{"a", "b", "rank", "overall", "by_type",
    "collapse_types"}, ...] best first, "recommendation": {"ring_pair": [a, b], "viable", "text",
    "flags": [...]}}.
    """
    if len(models) < 2:
        raise ValueError("the probe needs at least two models")
    pairs = [{"a": a, "b": b, **pair_report(models[a], models[b])} for a, b in itertools.combinations(models, 2)]
    pairs.sort(key=rank_key)
    for rank, p in enumerate(pairs, 1):
        p["rank"] = rank
    return {
        "rule": RULE,
        "models": {name: model_summary(rs) for name, rs in models.items()},
        "pairs": pairs,
        "recommendation": recommendation(pairs),
    }


def recommendation(ranked_pairs: Sequence[Mapping]) -> dict:
    """The best pair (first of `ranked_pairs`, already sorted by `rank_key`), whether it clears p_A + p_B > 1,
    a one-paragraph verdict, and every pair's collapse flags."""
    best = ranked_pairs[0]
    m = best["overall"]
    viable = m["acc_sum"] > 1
    kappa = "n/a" if m["kappa"] is None else f"{m['kappa']:.2f}"
    text = (
        f"Train `ring` with {best['a']} + {best['b']}: p_A + p_B = {m['acc_sum']:.3f} ± {m['acc_sum_se']:.3f}, "
        f"kappa {kappa}, complementarity {m['complementarity']:.3f}, same wrong answer {m['same_wrong']:.3f}."
    )
    if not viable:
        text += (
            " No pair has p_A + p_B > 1: the theory predicts a ring converges to a wrong consensus; "
            "improve the base models (warm start) before label-free training."
        )
    elif m["acc_sum"] - 2 * m["acc_sum_se"] <= 1:
        text += " p_A + p_B is within 2 standard errors of 1: probe more questions before relying on it."
    flags = [
        f"{p['a']} + {p['b']}: {t} (p_A + p_B = {p['by_type'][t]['acc_sum']:.3f}): {COLLAPSE_WARNING}"
        for p in ranked_pairs
        for t in p["collapse_types"]
    ]
    return {"ring_pair": [best["a"], best["b"]], "viable": viable, "text": text, "flags": flags}

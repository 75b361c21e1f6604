"""Cohort probe: `python -m vlm_corl.probe --models A B [C …] --benchmark easyvqa --limit N [--out DIR]`.

A pre-training diagnostic (docs/method.md): before training a cohort, evaluate each candidate member on a probe
set and measure, for every pair, how correlated their errors are. LABELS ARE USED HERE ONLY, as this
pre-training diagnostic, to score the probe set; label-free training never reads them.

Per pair (overall and per question type):
  kappa            Cohen's κ on the two correctness vectors (1 = errors on exactly the same questions,
                   0 = no more overlap than chance, < 0 = complementary);
  complementarity  share of questions exactly one of the two gets right;
  p_A + p_B        sum of the accuracies. Theory: a `ring` of two converges to the right answer when
                   p_A + p_B > 1 and to a wrong consensus when p_A + p_B < 1;
  both wrong       share of questions both get wrong;
  same wrong       share of questions both get wrong WITH THE SAME answer: the correlated-error signature
                   that lets a cohort reward itself into a shared wrong answer.

Recommendation (RULE below): pairs with p_A + p_B > 1 first, then lower κ, then higher complementarity; the
first pair is the one to train with `ring`. Every question type on which a pair has p_A + p_B < 1 is
flagged: expect collapse to a wrong consensus on that type.

Label headroom (`--samples K`, default 4; vlm_corl.headroom): one more pass per model, K answers per question at
the training temperature, and for every cohort of two or more models and every reward topology (ring, peers,
soft, self_vote, gt), computed by the reward modes' own code: how often each member's label is right where its
own vote is wrong, minus the reverse. Cohorts are ranked best first by the part of their `peers` headroom the
members' own samples can reach (a member with one constant answer learns nothing from anyone), with the
confidence prediction (the most self-consistent member's vote), κ and p_A + p_B of the votes beside it. It is
the bound on what a label-free reward can teach a greedily scored member; a pair's ring (or peers) headroom sums
to zero, so a pair can only trade gains between its two members.

The evaluation itself is `vlm_corl.eval` (same loading, rendering, decoding and grading; greedy for easyvqa),
so the probe's accuracies are the ones `vlm_corl.eval` reports. Greedy single answers are a proxy for the
training-time vote of K samples at temperature 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from vlm_corl import cli
from vlm_corl.data.answers import answers_equivalent
from vlm_corl.errors import UserError

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


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def probe_markdown(report: Mapping, title: str = "Cohort probe") -> str:
    """The probe as Markdown tables (what the CLI prints and writes to probe.md)."""
    types = sorted({t for m in report["models"].values() for t in m["by_type"]})
    lines = [
        f"# {title}",
        "",
        "Labels are used here only, as a pre-training diagnostic.",
        "",
        "## Models",
        "",
        "| model | n | accuracy | " + " | ".join(types) + (" |" if types else ""),
        "|---|---|---|" + "---|" * len(types),
    ]
    for name, m in report["models"].items():
        cells = [_fmt(m["by_type"].get(t)) for t in types]
        lines.append(f"| {name} | {m['n']} | {_fmt(m['accuracy'])} | " + " | ".join(cells) + (" |" if cells else ""))
    lines += [
        "",
        "## Pairs (best first)",
        "",
        "| rank | pair | questions | n | kappa | complementarity | p_A+p_B | both wrong | same wrong answer | flag |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["pairs"]:
        rows = [("all", p["overall"])] + list(p["by_type"].items())
        for t, m in rows:
            flag = (
                ("collapse risk" if t in p["collapse_types"] else "")
                if t != "all"
                else ("p_A+p_B > 1" if m["acc_sum"] > 1 else "p_A+p_B <= 1")
            )
            lines.append(
                f"| {p['rank']} | {p['a']} + {p['b']} | {t} | {m['n']} | {_fmt(m['kappa'], 2)} | "
                f"{_fmt(m['complementarity'])} | {m['acc_sum']:.3f} ± {m['acc_sum_se']:.3f} | "
                f"{_fmt(m['both_wrong'])} | {_fmt(m['same_wrong'])} | {flag} |"
            )
    rec = report["recommendation"]
    lines += ["", "## Recommendation", "", rec["text"], ""]
    if rec["flags"]:
        lines += ["Flags:", ""] + [f"- {f}" for f in rec["flags"]] + [""]
    lines += [f"Rule: {report['rule']}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# CLI: evaluate with vlm_corl.eval, then the maths above.


def model_names(specs: Sequence[str]) -> dict[str, str]:
    """{name: model dir} from `DIR` or `NAME=DIR` items; a bare DIR is named by its last path component, with
    parent components added until the names are unique."""
    named: list[tuple[str | None, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        named.append((name, path) if sep and name and "/" not in name else (None, spec))
    depth = 1
    while True:
        names = [n or "/".join(Path(p).resolve().parts[-depth:]) for n, p in named]
        if len(set(names)) == len(names):
            return dict(zip(names, (p for _, p in named)))
        if depth > max(len(Path(p).resolve().parts) for _, p in named):
            raise ValueError(f"model names are not unique: {names}")
        depth += 1


def sampled_headroom(models: Mapping[str, str], bench, examples, samples: int, temperature: float) -> dict:
    """Every cohort of two or more of `models` ranked by label headroom (vlm_corl.headroom.rank_cohorts), from one
    pass per model of `samples` answers per question at `temperature`."""
    from vlm_corl.evaluation.scoring import evaluate_dir
    from vlm_corl.headroom import rank_cohorts

    sampled = dataclasses.replace(bench, samples=samples, temperature=temperature)
    records = {}
    for name, path in models.items():
        print(f"[probe] sampling {name}: {samples} answers per question", file=sys.stderr, flush=True)
        records[name] = evaluate_dir(path, sampled, examples, name, progress=True)["records"]
    names = list(models)
    sets = [c for n in range(2, len(names) + 1) for c in itertools.combinations(names, n)]
    cohorts = {"+".join(c): {m: records[m] for m in c} for c in sets}
    return {"samples": samples, "temperature": temperature, "ranking": rank_cohorts(cohorts)}


def main(argv=None) -> int:
    from vlm_corl.evaluation.scoring import (  # registers the built-in benchmarks
        benchmark_examples,
        check_models,
        evaluate_dir,
    )
    from vlm_corl.registry import BENCHMARKS
    from vlm_corl.warmstart import labelled_slice

    parser = cli.parser(
        "python -m vlm_corl.probe",
        __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="Rule: " + RULE + "\n\nTo keep the test questions untouched, probe on a validation split carved "
        "from train: --split train --skip 35000 (easy-vqa train has 38,575 questions; the demo's labelled "
        "warm-start slices and unlabelled training questions come before that).",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        required=True,
        metavar="[NAME=]DIR",
        help="two or more model directories (HF format: zoo members, base models, checkpoints)",
    )
    parser.add_argument("--benchmark", default="easyvqa", help="a registered benchmark (default easyvqa)")
    parser.add_argument(
        "--limit",
        type=cli.positive_int,
        default=600,
        help="probe questions (balanced over question types where the benchmark defines them)",
    )
    parser.add_argument(
        "--split", default=None, help="dataset split instead of the benchmark's own (e.g. train, with --skip)"
    )
    parser.add_argument(
        "--skip", type=int, default=0, help="start after this many questions of the split (carves a validation slice)"
    )
    parser.add_argument("--data", default=None, metavar="PATH", help="data path, for a loader that needs one")
    parser.add_argument(
        "--samples",
        type=cli.positive_int,
        default=4,
        help="K answers sampled per question for the label headroom of every cohort (vlm_corl.headroom); 1 = skip it",
    )
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature of those answers (training's: 1.0)"
    )
    parser.add_argument("--out", default=None, help="directory for probe.json and probe.md")
    args = parser.parse_args(argv)
    if len(args.models) < 2:
        parser.error("--models needs at least two model directories")
    try:
        models = model_names(args.models)
    except ValueError as e:
        raise UserError(str(e)) from e

    out = cli.output_dir(args.out, "--out") if args.out else None
    bench = BENCHMARKS.get(args.benchmark)
    if args.split:
        bench = dataclasses.replace(bench, split=args.split)
    if args.skip:
        examples = labelled_slice(
            bench.loader, args.data or bench.path, bench.split, args.skip, args.limit, bench.balance_by
        )
    else:
        examples = benchmark_examples(bench, args.limit, args.data)
    check_models(models, examples)
    records = {}
    for name, path in models.items():
        print(
            f"[probe] evaluating {name} ({path}) on {len(examples)} {bench.name}[{bench.split}] questions",
            file=sys.stderr,
            flush=True,
        )
        records[name] = evaluate_dir(path, bench, examples, name, progress=True)["records"]

    report = probe(records)
    if args.samples > 1:  # one sampled pass per model; every cohort's label headroom from those records
        report["headroom"] = sampled_headroom(models, bench, examples, args.samples, args.temperature)
    balance = f", balanced by {bench.balance_by}" if bench.balance_by else ""
    skip = f", after the first {args.skip}" if args.skip else ""
    title = f"Cohort probe: {bench.name} [{bench.split}{skip}], {len(examples)} questions{balance}"
    report = {
        "benchmark": bench.name,
        "split": bench.split,
        "skip": args.skip,
        "limit": args.limit,
        "n": len(examples),
        "model_dirs": models,
        **report,
        "records": records,
    }
    text = probe_markdown(report, title)
    if "headroom" in report:
        from vlm_corl.headroom import HEADROOM_NOTE, ranking_markdown

        h = report["headroom"]
        text += "\n".join(
            [
                "",
                f"## Label headroom of every cohort (K = {h['samples']} samples at temperature {h['temperature']}; "
                "best first by peers headroom)",
                "",
                HEADROOM_NOTE,
                "",
                *ranking_markdown(h["ranking"]),
                "",
            ]
        )
    print(text)
    if out is not None:
        (out / "probe.json").write_text(json.dumps(report, indent=2))
        (out / "probe.md").write_text(text)
        print(f"[probe] wrote {out / 'probe.json'} and {out / 'probe.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))

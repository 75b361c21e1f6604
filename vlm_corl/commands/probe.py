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

Label headroom (`--samples K`, default 4; vlm_corl.training.rewards.headroom): one more pass per model, K answers per
question at the training temperature, and for every cohort of two or more models and every reward topology (ring, peers,
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
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from vlm_corl import cli
from vlm_corl.errors import UserError
from vlm_corl.evaluation.pairs import RULE, probe


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
    """Every cohort of two or more of `models` ranked by label headroom (training.headroom.rank_cohorts), from
    one pass per model of `samples` answers per question at `temperature`."""
    from vlm_corl.evaluation.scoring import evaluate_dir
    from vlm_corl.training.rewards.headroom import rank_cohorts

    sampled = dataclasses.replace(bench, samples=samples, temperature=temperature)
    records = {}
    for name, path in models.items():
        print(f"[probe] sampling {name}: {samples} answers per question", file=sys.stderr, flush=True)
        records[name] = evaluate_dir(path, sampled, examples, name, progress=True)["records"]
    names = list(models)
    sets = [c for n in range(2, len(names) + 1) for c in itertools.combinations(names, n)]
    cohorts = {"+".join(c): {m: records[m] for m in c} for c in sets}
    return {"samples": samples, "temperature": temperature, "ranking": rank_cohorts(cohorts)}


def probe_parser() -> argparse.ArgumentParser:
    """The probe's arguments; every number is checked here (exit 2 naming the flag), before any model loads."""
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
        "--skip",
        type=cli.non_negative_int,
        default=0,
        help="start after this many questions of the split, at least 0 (carves a validation slice)",
    )
    parser.add_argument("--data", default=None, metavar="PATH", help="data path, for a loader that needs one")
    parser.add_argument(
        "--samples",
        type=cli.positive_int,
        default=4,
        help="K answers sampled per question for the label headroom of every cohort (training.headroom); 1 = skip",
    )
    parser.add_argument(
        "--temperature",
        type=cli.positive_float,
        default=1.0,
        help="sampling temperature of those answers, above 0 (training's: 1.0; rollouts are never greedy)",
    )
    parser.add_argument("--out", default=None, help="directory for probe.json and probe.md")
    return parser


def main(argv=None) -> int:
    """`python -m vlm_corl.probe`: evaluate the models, print the probe and write it to `--out`."""
    parser = probe_parser()
    args = cli.parse(parser, argv)
    # torch and transformers load only now: `--help` and argument mistakes answer at once
    from vlm_corl.evaluation.scoring import check_models, evaluate_dir
    from vlm_corl.registry import BENCHMARKS

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
    examples = _probe_set(args, bench)
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
    text = probe_markdown(report, title) + (headroom_markdown(report["headroom"]) if "headroom" in report else "")
    print(text)
    if out is not None:
        (out / "probe.json").write_text(json.dumps(report, indent=2))
        (out / "probe.md").write_text(text)
        print(f"[probe] wrote {out / 'probe.json'} and {out / 'probe.md'}", file=sys.stderr)
    return 0


def _probe_set(args, bench) -> list:
    """The probe's questions: the benchmark's (balanced where defined), or with --skip a labelled slice after the
    first --skip examples."""
    from vlm_corl.evaluation.scoring import benchmark_examples
    from vlm_corl.models.warmstart import Slice, labelled_slice

    if args.skip:
        part = Slice(bench.loader, args.limit, args.skip, bench.split, args.data or bench.path, bench.balance_by)
        return labelled_slice(part)
    return benchmark_examples(bench, args.limit, args.data)


def headroom_markdown(h: Mapping) -> str:
    """probe.md's section on every cohort's label headroom (`sampled_headroom`'s report)."""
    from vlm_corl.training.rewards.headroom import HEADROOM_NOTE, ranking_markdown

    title = (
        f"## Label headroom of every cohort (K = {h['samples']} samples at temperature {h['temperature']}; "
        "best first by peers headroom)"
    )
    return "\n".join(["", title, "", HEADROOM_NOTE, "", *ranking_markdown(h["ranking"]), ""])


if __name__ == "__main__":
    sys.exit(cli.run(main))

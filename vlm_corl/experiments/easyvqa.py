"""The label-free learning experiment on real easy-vqa: do complementary cohorts teach themselves?

    python -m vlm_corl.experiments.easyvqa --out DIR [--quick] [--seeds 5] [--workers 2] [--rl-steps 120]
        [--plots-only]

Five base models, built once (tiny Qwen2-VL-style members warm-started on their own labelled slices of
easy-vqa train before question 20000; vlm_corl.experiments.easyvqa_data): A and A2 mostly on images of
palette A's colours, B and B2 mostly on palette B's (A2 and B2: the same skills from another initialisation
and slice), M half and half. The probe (vlm_corl.probe) measures every cohort on validation (train from
question 35000) before any training. Then, per seed (the RL seed: sampling and data order), with identical
budgets on the unlabelled pool (colour and yes/no questions, chosen by wording, of train [20000, 35000)):
Co-RL `ring` on the complementary pair A+B, on the homogeneous pairs A+A2 and B+B2, on A+M and B+M; Co-RL on
the three members A+B+M (`ring` and `peers`); `self_vote` (TTRL); the frozen-peer control (A learns from a
frozen B and B from a frozen A, in one run); and `gt` (gold answers), the reference. Every trained member is
evaluated on easy-vqa test, balanced over question types.

Writes results.json, results.md (the tables, the probe-vs-gain analysis with Spearman's rank correlation,
and a verdict on each claim) and PNG plots. Every choice (warm-start steps and mix, pool, learning rate,
budget) was made on validation, never on test: the README's experiment section lists what was tried.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from vlm_corl import cli
from vlm_corl.demo import BaseRecipe, build_base
from vlm_corl.errors import UserError
from vlm_corl.evaluation.scoring import write_results
from vlm_corl.experiments import easyvqa_analysis as analysis
from vlm_corl.experiments.easyvqa_data import PALETTES, UNLABELLED_START, VALIDATION_START, skill_mix

DATA = "vlm_corl.experiments.easyvqa_data"
POOL = ["color", "yes/no"]  # shape is left out: the probe puts p_A + p_B below 1 on it for every pair


@dataclass(frozen=True)
class Budget:
    """Identical for every method of one experiment."""

    warm_steps: int
    rl_steps: int
    eval_limit: int  # test questions, balanced over the 3 question types
    probe_limit: int  # validation questions the probe evaluates each base model on
    seeds: int
    batch_size: int = 16
    rl_lr: float = 3e-4
    rollout_n: int = 4
    own_share: float = 0.8  # of a specialist's labelled questions, on images of its own palette


FULL = Budget(warm_steps=1000, rl_steps=120, eval_limit=600, probe_limit=600, seeds=5, rl_lr=4e-4)
QUICK = Budget(warm_steps=10, rl_steps=2, eval_limit=15, probe_limit=15, seeds=2, batch_size=4)


def base_recipes(budget: Budget) -> dict[str, BaseRecipe]:
    """The five base models: each its own labelled slice (1000 questions, 4000 apart) and zoo initialisation."""

    def recipe(k: int, palette: str, own: float) -> BaseRecipe:
        return BaseRecipe(
            "qwen2_vl",
            "tiny",
            4000 * k,
            1000,
            steps=budget.warm_steps,
            init_seed=100 * k,
            mix=skill_mix(palette, own),
            balance="skill",
            loader=f"{DATA}:labelled",
        )

    own = budget.own_share
    return {
        "A": recipe(0, "A", own),
        "B": recipe(1, "B", own),
        "A2": recipe(2, "A", own),
        "B2": recipe(3, "B", own),
        "M": recipe(4, "A", 0.5),
    }


# method -> (members [(id, base, overrides)], reward mode)
METHODS = {
    "ring, complementary A+B": ([("A", "A", {}), ("B", "B", {})], "ring"),
    "ring, homogeneous A+A2": ([("A", "A", {}), ("A2", "A2", {})], "ring"),
    "ring, homogeneous B+B2": ([("B", "B", {}), ("B2", "B2", {})], "ring"),
    "ring, A+M": ([("A", "A", {}), ("M", "M", {})], "ring"),
    "ring, B+M": ([("B", "B", {}), ("M", "M", {})], "ring"),
    "ring, 3 members A+B+M": ([("A", "A", {}), ("B", "B", {}), ("M", "M", {})], "ring"),
    "peers, 3 members A+B+M": ([("A", "A", {}), ("B", "B", {}), ("M", "M", {})], "peers"),
    "self_vote (TTRL)": ([("A", "A", {}), ("B", "B", {})], "self_vote"),
    # ring order: B is labelled by the frozen A, A by the frozen B (member n by member n-1)
    "frozen peer": (
        [
            ("A_frozen", "A", {"trainable": False}),
            ("B", "B", {}),
            ("B_frozen", "B", {"trainable": False}),
            ("A", "A", {}),
        ],
        "ring",
    ),
    "gt (labels)": ([("A", "A", {}), ("B", "B", {})], "gt"),
}
# the ring cohorts of the probe-vs-gain analysis (a cohort's probe: the mean over its pairs)
RING_COHORTS = (
    "ring, complementary A+B",
    "ring, homogeneous A+A2",
    "ring, homogeneous B+B2",
    "ring, A+M",
    "ring, B+M",
    "ring, 3 members A+B+M",
)
CLAIM_METHODS = {
    "complementary": "ring, complementary A+B",
    "homogeneous": "ring, homogeneous A+A2",
    "self_vote": "self_vote (TTRL)",
    "gt": "gt (labels)",
}


def slug(method: str) -> str:
    """A method's name as a directory name."""
    return re.sub(r"[^a-z0-9]+", "-", method.lower()).strip("-")


def method_config(method: str, seed: int, budget: Budget, out: Path) -> dict:
    """The cohort config of one method's run with one seed."""
    members, mode = METHODS[method]
    name = f"{slug(method)}-seed{seed}"
    return {
        "name": name,
        "output_dir": str(out / "runs" / name),
        "seed": seed,
        "members": [{"id": mid, "model": str(out / "base" / base), **extra} for mid, base, extra in members],
        "data": {
            "train": {
                "loader": f"{DATA}:load",
                "options": {"start": UNLABELLED_START, "stop": VALIDATION_START, "asked": POOL, "balanced": True},
            },
            "batch_size": budget.batch_size,
            "seed": seed,
        },
        "rollout": {"n": budget.rollout_n, "max_new_tokens": 12},
        "reward": {"mode": mode},
        "train": {
            "max_steps": budget.rl_steps,
            "lr": budget.rl_lr,
            "save_every": 0,
            "micro_batch_size": 64,
            "overwrite": True,
        },  # a re-run of the experiment redoes its runs
        "logging": {"tensorboard": False, "progress": False},
    }


def relative_to(value, root: Path):
    """`value` (nested dicts/lists) with every path string under `root` made relative to it, so results files
    hold no absolute paths of the machine that wrote them."""
    if isinstance(value, dict):
        return {k: relative_to(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_to(v, root) for v in value]
    if isinstance(value, str):
        for prefix in {str(root.resolve()), str(root)}:
            if value.startswith(prefix + "/"):
                return value[len(prefix) + 1 :]
    return value


# ---- worker jobs (spawned processes, one torch thread each) -----------------------------------------------


def eval_examples(split: str, limit: int) -> list:
    """The questions trained members are scored on: easy-vqa `test`, or `validation` (train from #35000) when
    choosing settings; both balanced over question types."""
    from vlm_corl.evaluation.scoring import EASYVQA, benchmark_examples
    from vlm_corl.experiments.easyvqa_data import validation

    return validation(limit) if split == "validation" else benchmark_examples(EASYVQA, limit)


def make_base(mid: str, recipe: BaseRecipe, out: Path, budget: Budget, split: str) -> dict:
    """Build one base model, score it on `split` ("test"), and save its validation records (the probe's input)
    next to it as probe_records.json."""
    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir

    build = build_base(mid, recipe, out, seed=0)  # bases differ by slice and initialisation (recipe.init_seed)
    test = evaluate_dir(out, EASYVQA, eval_examples(split, budget.eval_limit), mid)
    val = evaluate_dir(out, EASYVQA, eval_examples("validation", budget.probe_limit), mid)
    keep = ("id", "type", "pred", "gold", "correct")
    (out / "probe_records.json").write_text(json.dumps([{k: r[k] for k in keep} for r in val["records"]]))
    return {"build": build, "test": _brief(test), "validation": _brief(val)}


def run_method(cfg_dict: dict, eval_limit: int, split: str) -> dict:
    """One training run, then every trained member scored on `split` ("test"); the first/last values of the
    answer-diversity metrics per trained member."""
    import torch

    from vlm_corl.config import config_from_dict
    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir
    from vlm_corl.report import first_last, read_jsonl
    from vlm_corl.training.loop import run_cohort

    torch.set_num_threads(1)
    start = time.time()
    summary = run_cohort(config_from_dict(cfg_dict))
    examples = eval_examples(split, eval_limit)
    final = Path(summary["checkpoint"])
    trained = [m["id"] for m in cfg_dict["members"] if m.get("trainable", True)]
    rows = read_jsonl(Path(cfg_dict["output_dir"]) / "metrics.jsonl")
    diversity = {
        mid: {
            k: first_last([r for r in rows if r["member"] == mid], k)
            for k in ("distinct_answers", "answer_entropy", "answer_entropy_batch")
        }
        for mid in trained
    }
    return {
        "eval": {mid: _brief(evaluate_dir(final / mid, EASYVQA, examples, mid)) for mid in trained},
        "diversity": diversity,
        "run_dir": cfg_dict["output_dir"],
        "seconds": round(time.time() - start, 1),
        "summary": summary,
    }


def _brief(result: dict) -> dict:
    return {"accuracy": result["accuracy"], "by_type": result["by_type"]}


def question_only_baseline(split: str, eval_limit: int) -> dict:
    """Accuracy on the `split` questions of answering, for each question string, the most common answer it has
    in the training split (no image): how much a question type can be solved without seeing."""
    from vlm_corl.data.answers import answers_equivalent
    from vlm_corl.data.loaders import load_examples

    answers_by_question: dict[str, Counter] = defaultdict(Counter)
    for ex in load_examples("easyvqa", split="train").examples:
        answers_by_question[ex.question][ex.answer] += 1
    by_type = defaultdict(list)
    for ex in eval_examples(split, eval_limit):
        guess = answers_by_question[ex.question].most_common(1)[0][0] if ex.question in answers_by_question else None
        by_type[ex.metadata["question_type"]].append(answers_equivalent(ex.answer, guess))
    return {
        "accuracy": statistics.fmean(ok for v in by_type.values() for ok in v),
        "by_type": {t: statistics.fmean(v) for t, v in sorted(by_type.items())},
    }


# ---- from the per-seed results to the tables -------------------------------------------------------------


def probe_pairs(out: Path, bases: list[str]) -> dict[str, dict]:
    """{"X+Y": vlm_corl.probe.pair_report} of every pair of base models, from their saved validation records."""
    from vlm_corl.probe import pair_report

    records = {b: json.loads((out / "base" / b / "probe_records.json").read_text()) for b in bases}
    return {f"{a}+{b}": pair_report(records[a], records[b]) for a, b in itertools.combinations(bases, 2)}


def cohort_bases(method: str) -> list[str]:
    """The base models of a method's cohort, in member order, each once (the frozen copies included)."""
    return list(dict.fromkeys(base for _, base, _ in METHODS[method][0]))


def analyse(results: dict) -> dict:
    """results with the tables, the probe of every cohort, the probe-vs-gain analysis and the claims
    (re)computed from its seeds and base models."""
    base_of = {(m, mid): base for m, (members, _) in METHODS.items() for mid, base, _ in members}
    seeded = analysis.per_seed(results, lambda m, mid: base_of[(m, mid)])
    cohorts = {m: analysis.cohort_probe(results["probe"], cohort_bases(m)) for m in METHODS}
    pg = analysis.probe_vs_gain(seeded, cohorts, RING_COHORTS)
    return {
        **results,
        "base_table": analysis.base_table(results["bases"]),
        "cohort_probe": cohorts,
        "table": analysis.method_table(seeded),
        "probe_gain": pg,
        "claims": analysis.claims(results, seeded, pg, CLAIM_METHODS),
    }


def plot_all(out: Path, results: dict) -> list[str]:
    """The probe-vs-gain scatter and one PNG per training diagnostic over steps (one line per method, the
    mean over seeds and trained members, read from the runs' metrics.jsonl)."""
    from vlm_corl.report import plot_metric, read_jsonl

    paths = [analysis.plot_probe_vs_gain(results["probe_gain"], out / "probe_vs_gain.png").name]
    curves = {
        "pseudo_label_acc": "pseudo-label accuracy (diagnostic, vs gold)",
        "reward": "reward",
        "agreement": "agreement with the label source",
        "distinct_answers": "distinct answers per group",
        "answer_entropy_batch": "answer entropy across the batch (nats)",
    }
    for key, title in curves.items():
        runs = {}
        for method, (members, _) in METHODS.items():
            trained = {mid for mid, _, extra in members if extra.get("trainable", True)}
            rows = [
                row
                for seed in results["seeds"]
                for row in read_jsonl(out / "runs" / f"{slug(method)}-seed{seed}" / "metrics.jsonl")
                if row["member"] in trained and row.get("reward_mean" if key == "reward" else key) is not None
            ]
            if rows:
                runs[method] = rows
        if runs:
            plot_metric(runs, "reward_mean" if key == "reward" else key, out / f"{key}.png", title)
            paths.append(f"{key}.png")
    return paths


def finish(out: Path, results: dict) -> None:
    """Analyse, write results.json/md (before plotting, so the table is safe on disk), plot, write again."""
    results = {**analyse(results), "plots": []}
    write_results(out, results, analysis.markdown(results))
    results["plots"] = plot_all(out, results)
    write_results(out, results, analysis.markdown(results))


# ---- the command --------------------------------------------------------------------------------------------


def run_all(out: Path, budget: Budget, workers: int, split: str) -> dict:
    """Every base model, then every method of every seed, `workers` processes at a time; members are scored
    on `split`."""
    start = time.time()
    seeds = range(budget.seeds)
    results = {
        "budget": asdict(budget),
        "split": split,
        "pool": POOL,
        "palettes": PALETTES,
        "bases": {},
        "seeds": {},
        "workers": workers,
    }
    with (
        ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool,
        tqdm(
            total=len(base_recipes(budget)) + budget.seeds * len(METHODS),
            desc="experiment",
            unit="job",
            file=sys.stdout,
            mininterval=5,
        ) as bar,
    ):
        bases = {
            mid: pool.submit(make_base, mid, recipe, out / "base" / mid, budget, split)
            for mid, recipe in base_recipes(budget).items()
        }
        for mid, job in bases.items():
            results["bases"][mid] = job.result()
            bar.update()
        bar.write(f"[experiment] base models built ({len(bases)}) at {time.time() - start:.0f} s")
        # the three-member runs first: the longest jobs start early and the pool ends evenly
        order = sorted(METHODS, key=lambda m: -len(METHODS[m][0]))
        runs = {
            (s, m): pool.submit(run_method, method_config(m, s, budget, out), budget.eval_limit, split)
            for s in seeds
            for m in order
        }
        for (s, m), job in runs.items():
            results["seeds"].setdefault(str(s), {})[m] = job.result()
            bar.write(f"[experiment] seed {s} {m}: {results['seeds'][str(s)][m]['seconds']} s")
            bar.update()
    results["seeds"] = {s: {m: results["seeds"][s][m] for m in METHODS} for s in results["seeds"]}
    results["probe"] = probe_pairs(out, list(bases))
    results["question_only"] = question_only_baseline(split, budget.eval_limit)
    results["seconds"] = round(time.time() - start, 1)
    return relative_to(results, out)


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.experiments.easyvqa", __doc__)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="a tiny budget with 2 seeds, for smoke runs")
    parser.add_argument(
        "--seeds",
        type=cli.positive_int,
        default=None,
        help=f"number of seeds, at least 2 (default {FULL.seeds}, or {QUICK.seeds} with --quick)",
    )
    parser.add_argument("--workers", type=cli.positive_int, default=2, help="runs in parallel (one CPU thread each)")
    parser.add_argument(
        "--rl-steps",
        type=cli.positive_int,
        default=None,
        help=f"RL steps of every method (default {FULL.rl_steps}, what fits 45 minutes on 2 cores; at 960 `gt` gained"
        " +7.75 points on validation, with each run about 4 times longer)",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="score members on validation (train from #35000) instead of test: for choosing settings",
    )
    parser.add_argument(
        "--plots-only",
        action="store_true",
        help="recompute the tables and redraw the plots of a finished experiment in --out",
    )
    args = parser.parse_args(argv)
    if args.seeds == 1:
        parser.error("--seeds must be at least 2: the homogeneous pairs take their second member from another seed")
    out = cli.output_dir(args.out, "--out")
    if args.plots_only:
        if not (out / "results.json").is_file():
            raise UserError(
                f"--plots-only redraws a finished experiment, but {out / 'results.json'} does not exist: "
                "run the experiment into --out first"
            )
        finish(out, json.loads((out / "results.json").read_text()))
        return 0
    budget = QUICK if args.quick else FULL
    if args.seeds:
        budget = Budget(**{**asdict(budget), "seeds": args.seeds})
    if args.rl_steps:
        budget = Budget(**{**asdict(budget), "rl_steps": args.rl_steps})
    finish(out, run_all(out, budget, args.workers, "validation" if args.tune else "test"))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))

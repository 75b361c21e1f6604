"""The label-free learning experiment on real easy-vqa: the paper's table at tiny scale.

    python -m vlm_corl.experiments.easyvqa --out DIR [--quick] [--seeds 3]

Per seed: warm-start base models (each on its own balanced labelled slice of easy-vqa train, drawn before
question 20000), then, with identical budgets on unlabelled train questions from 20000 on, train:
Co-RL `ring` on a diverse cohort (Qwen2-VL-style + Mllama-style), Co-RL on a homogeneous cohort (two
Qwen2-VL-style members from different seeds and slices), Co-RL with different views per member (the Mllama
member reads easy-vqa's template paraphrases), `self_vote` (TTRL) per member, the frozen-peer control, and
`gt` (gold answers) as the upper reference. Every member is evaluated before and after on easy-vqa test,
balanced over question types, next to the question-only baseline (the most common training answer for each
question string, without looking at the image). Writes results.json, results.md and PNG plots of test
accuracy, reward, agreement, pseudo-label accuracy and answer diversity over steps, one line per method.

Recipes (warm-start steps and learning rates, the RL learning rate) were chosen on a validation split carved
from the end of easy-vqa train, never on test.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vlm_corl import cli
from vlm_corl.demo import BaseRecipe, build_base
from vlm_corl.errors import UserError
from vlm_corl.eval import write_results

TRAIN_SKIP = 20000  # unlabelled training questions start here; the labelled slices lie before


@dataclass(frozen=True)
class Budget:
    """Identical for every method of one experiment."""

    warm_steps: int
    rl_steps: int
    eval_limit: int  # test questions, balanced over the 3 question types
    curve_every: int  # steps between the in-training test evaluations (the accuracy curves)
    curve_limit: int
    batch_size: int = 16
    rl_lr: float = 1e-4
    train_limit: int = 8000


FULL = Budget(warm_steps=1000, rl_steps=150, eval_limit=600, curve_every=50, curve_limit=150)
QUICK = Budget(warm_steps=200, rl_steps=12, eval_limit=90, curve_every=6, curve_limit=30, batch_size=8)


def base_recipes(budget: Budget, seed: int) -> dict[str, BaseRecipe]:
    """The base models of one seed; slices shift with the seed so seeds see different labelled data."""
    off = 1000 * seed
    return {
        "qwen": BaseRecipe("qwen2_vl", "tiny", off, 1000, steps=budget.warm_steps),
        "llama": BaseRecipe("mllama", "tiny", 10000 + off, 1000, steps=budget.warm_steps, lr=4e-3),
        "qwen_b": BaseRecipe("qwen2_vl", "tiny", 5000 + off, 1000, steps=budget.warm_steps, init_seed=100),
    }


# method -> (members: [(id, base, overrides)], reward mode)
METHODS = {
    "co-rl ring, diverse": ([("qwen", "qwen", {}), ("llama", "llama", {})], "ring"),
    "co-rl ring, homogeneous": ([("qwen", "qwen", {}), ("qwen_b", "qwen_b", {"seed": 1})], "ring"),
    "co-rl ring, diverse + views": ([("qwen", "qwen", {}), ("llama", "llama", {"view": "paraphrase:1"})], "ring"),
    "self_vote (TTRL)": ([("qwen", "qwen", {}), ("llama", "llama", {})], "self_vote"),
    "frozen peer": ([("qwen", "qwen", {}), ("llama", "llama", {"trainable": False})], "ring"),
    "gt (labels)": ([("qwen", "qwen", {}), ("llama", "llama", {})], "gt"),
}


def method_config(method: str, seed: int, budget: Budget, out: Path, bases: dict[str, str]) -> dict:
    members, mode = METHODS[method]
    slug = re.sub(r"[^a-z0-9]+", "-", method.lower()).strip("-")
    return {
        "name": f"{slug}-seed{seed}",
        "output_dir": str(out / "runs" / f"{slug}-seed{seed}"),
        "seed": seed,
        "members": [{"id": mid, "model": bases.get(base), **extra} for mid, base, extra in members],
        "data": {"train": {"loader": "easyvqa", "skip": TRAIN_SKIP, "limit": budget.train_limit},
                 "batch_size": budget.batch_size, "seed": seed},
        "rollout": {"n": 4, "max_new_tokens": 12},
        "reward": {"mode": mode},
        "train": {"max_steps": budget.rl_steps, "lr": budget.rl_lr, "save_every": 0, "micro_batch_size": 32,
                  "overwrite": True},  # a re-run of the experiment redoes its runs
        "eval": {"benchmarks": ["easyvqa"], "every": budget.curve_every, "limit": budget.curve_limit},
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


def run_method(cfg_dict: dict, eval_limit: int) -> dict:
    """One training run (in a worker process), then every member evaluated on easy-vqa test."""
    import torch

    from vlm_corl.config import config_from_dict
    from vlm_corl.eval import benchmark_examples, evaluate_dir
    from vlm_corl.loop import run_cohort
    from vlm_corl.registry import BENCHMARKS

    torch.set_num_threads(1)
    start = time.time()
    summary = run_cohort(config_from_dict(cfg_dict))
    bench = BENCHMARKS.get("easyvqa")
    examples = benchmark_examples(bench, eval_limit)
    final = Path(summary["checkpoint"])
    evals = {m["id"]: _brief(evaluate_dir(final / m["id"], bench, examples, m["id"])) for m in cfg_dict["members"]}
    return {"eval": evals, "run_dir": cfg_dict["output_dir"], "seconds": round(time.time() - start, 1), "summary": summary}


def evaluate_bases(bases: dict[str, str], eval_limit: int) -> dict:
    import torch

    from vlm_corl.eval import benchmark_examples, evaluate_dir
    from vlm_corl.registry import BENCHMARKS

    torch.set_num_threads(1)
    bench = BENCHMARKS.get("easyvqa")
    examples = benchmark_examples(bench, eval_limit)
    return {mid: _brief(evaluate_dir(path, bench, examples, mid)) for mid, path in bases.items()}


def question_only_baseline(eval_limit: int) -> dict:
    """Accuracy on the evaluation questions of answering, for each question string, the most common answer
    it has in the training split (no image): how much a question type can be solved without seeing."""
    from vlm_corl.answers import answers_equivalent
    from vlm_corl.data import load_examples
    from vlm_corl.eval import benchmark_examples
    from vlm_corl.registry import BENCHMARKS

    answers_by_question: dict[str, Counter] = defaultdict(Counter)
    for ex in load_examples("easyvqa", split="train").examples:
        answers_by_question[ex.question][ex.answer] += 1
    records = []
    for ex in benchmark_examples(BENCHMARKS.get("easyvqa"), eval_limit):
        guess = answers_by_question[ex.question].most_common(1)[0][0] if ex.question in answers_by_question else None
        records.append((ex.metadata["question_type"], answers_equivalent(ex.answer, guess)))
    by_type = defaultdict(list)
    for qtype, ok in records:
        by_type[qtype].append(ok)
    return {"accuracy": statistics.fmean(ok for _, ok in records),
            "by_type": {t: statistics.fmean(v) for t, v in sorted(by_type.items())}}


def _brief(result: dict) -> dict:
    return {"accuracy": result["accuracy"], "by_type": result["by_type"]}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def aggregate(seeds: dict) -> dict:
    """{method: {member: {"accuracy": mean/std, "delta": mean/std vs its base, "by_type": {t: mean/std}}}}."""
    table: dict = {}
    for method in ["base models"] + list(METHODS):
        per_member: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for seed in seeds.values():
            evals = seed["bases"] if method == "base models" else seed["methods"][method]["eval"]
            for mid, r in evals.items():
                per_member[mid]["accuracy"].append(r["accuracy"])
                per_member[mid]["delta"].append(r["accuracy"] - seed["bases"][mid]["accuracy"])
                for t, a in r["by_type"].items():
                    per_member[mid][t].append(a)
        table[method] = {mid: {k: mean_std(v) for k, v in vals.items()} for mid, vals in per_member.items()}
    return table


def results_markdown(results: dict) -> str:
    b = results["budget"]
    lines = [
        "# Label-free learning on easy-vqa (tiny models, CPU)",
        "",
        f"Seeds: {len(results['seeds'])}. Budget per method: {b['rl_steps']} steps × {b['batch_size']} questions × "
        f"K=4, lr {b['rl_lr']}; base models: {b['warm_steps']} supervised steps on 1000 labelled questions "
        f"(balanced by type). Test: {b['eval_limit']} easy-vqa test questions balanced over yes/no, shape, colour; "
        "greedy. Mean ± std over seeds; Δ = change vs the member's own base model.",
        "",
        "| method | member | accuracy | Δ vs base | yes/no | shape | colour |",
        "|---|---|---|---|---|---|---|",
    ]
    q = results["question_only"]
    lines.append(f"| question-only baseline | (no image) | {q['accuracy']:.3f} | | {q['by_type']['yes/no']:.3f} | "
                 f"{q['by_type']['shape']:.3f} | {q['by_type']['color']:.3f} |")
    for method, members in results["table"].items():
        for mid, r in members.items():
            fmt = lambda k: f"{r[k]['mean']:.3f} ± {r[k]['std']:.3f}"  # noqa: E731
            delta = "" if method == "base models" else f"{r['delta']['mean']:+.3f} ± {r['delta']['std']:.3f}"
            lines.append(f"| {method} | {mid} | {fmt('accuracy')} | {delta} | {fmt('yes/no')} | {fmt('shape')} | "
                         f"{fmt('color')} |")
    lines += ["", f"Wall time: {results['seconds'] / 60:.1f} min. Plots: " +
              ", ".join(f"`{p}`" for p in results["plots"]), ""]
    return "\n".join(lines)


def plot_curves(out: Path, n_seeds: int, budget: Budget) -> list[str]:
    """One PNG per diagnostic over steps, one line per method (mean over seeds and members), read from the
    runs' metrics.jsonl / eval.jsonl (so `--plots-only` can redraw them after the fact)."""
    from vlm_corl.report import plot_metric

    curves = {
        "test_accuracy": ("eval.jsonl", "accuracy", "easy-vqa test accuracy (in-training eval)"),
        "reward": ("metrics.jsonl", "reward_mean", "reward"),
        "agreement": ("metrics.jsonl", "agreement", "agreement with the label source"),
        "pseudo_label_acc": ("metrics.jsonl", "pseudo_label_acc", "pseudo-label accuracy (diagnostic, vs gold)"),
        "distinct_answers": ("metrics.jsonl", "distinct_answers", "distinct answers per group"),
        "answer_entropy": ("metrics.jsonl", "answer_entropy", "answer entropy per group (nats)"),
    }
    paths = []
    for name, (file, key, title) in curves.items():
        runs = {}
        for method in METHODS:
            rows = [row for s in range(n_seeds)
                    for row in _read_jsonl(Path(method_config(method, s, budget, out, {})["output_dir"]) / file)
                    if row.get(key) is not None]
            if rows:
                runs[method] = rows
        if runs:
            path = out / f"{name}.png"
            plot_metric(runs, key, path, title)
            paths.append(path.name)
    return paths


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.experiments.easyvqa", __doc__)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="a small budget (one seed by default), for smoke runs")
    parser.add_argument("--seeds", type=cli.positive_int, default=None, help="number of seeds (default 3, or 1 with --quick)")
    parser.add_argument("--workers", type=cli.positive_int, default=2, help="training runs in parallel (one CPU thread each)")
    parser.add_argument("--plots-only", action="store_true",
                        help="redraw the plots and results.md of a finished experiment in --out")
    args = parser.parse_args(argv)
    budget = QUICK if args.quick else FULL
    n_seeds = args.seeds or (1 if args.quick else 3)
    out = cli.output_dir(args.out, "--out")
    if args.plots_only:
        if not (out / "results.json").is_file():
            raise UserError(f"--plots-only redraws a finished experiment, but {out / 'results.json'} does not exist: "
                            "run the experiment into --out first")
        results = json.loads((out / "results.json").read_text())
        results["plots"] = plot_curves(out, results["budget"]["seeds"], budget)
        write_results(out, results, results_markdown(results))
        return 0
    start = time.time()
    spawn = multiprocessing.get_context("spawn")
    seeds: dict[int, dict] = {}
    with ProcessPoolExecutor(args.workers, mp_context=spawn) as pool:
        bases = {s: {mid: str(out / "base" / f"seed{s}" / mid) for mid in base_recipes(budget, s)} for s in range(n_seeds)}
        jobs = [pool.submit(build_base, mid, recipe, Path(bases[s][mid]), s)
                for s in range(n_seeds) for mid, recipe in base_recipes(budget, s).items()]
        total = len(jobs) + n_seeds * (1 + len(METHODS))
        with tqdm(total=total, desc="experiment", unit="job", file=sys.stdout, mininterval=5) as bar:
            for job in jobs:
                job.result()
                bar.update()
            bar.write(f"[experiment] base models built ({len(jobs)}) at {time.time() - start:.0f} s")
            base_evals = {s: pool.submit(evaluate_bases, bases[s], budget.eval_limit) for s in range(n_seeds)}
            runs = {(s, m): pool.submit(run_method, method_config(m, s, budget, out, bases[s]), budget.eval_limit)
                    for s in range(n_seeds) for m in METHODS}
            for s in range(n_seeds):
                seeds[s] = {"bases": base_evals[s].result(), "methods": {}}
                bar.update()
            for (s, m), job in runs.items():
                seeds[s]["methods"][m] = job.result()
                bar.write(f"[experiment] seed {s} {m}: {seeds[s]['methods'][m]['seconds']} s")
                bar.update()
    results = {
        "budget": vars(budget) | {"seeds": n_seeds},
        "question_only": question_only_baseline(budget.eval_limit),
        "table": aggregate(seeds),
        "seeds": seeds,
        "plots": [],
        "seconds": round(time.time() - start, 1),
    }
    results = relative_to(results, out)
    write_results(out, results, results_markdown(results))  # the table is safe on disk before plotting
    results["plots"] = plot_curves(out, n_seeds, budget)
    write_results(out, results, results_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))

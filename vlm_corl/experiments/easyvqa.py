"""The label-free learning experiment on real easy-vqa: do diverse cohorts teach themselves from their peers?

    python -m vlm_corl.experiments.easyvqa --out DIR [--quick] [--seeds 5] [--workers 2] [--rl-steps 480]
        [--tune] [--plots-only]

1. Base models (vlm_corl.experiments.easyvqa_design): one tiny member per zoo VLM family and four more
   qwen2_vl ones, each warm-started on its own labelled slice; each scored greedily on test and on validation
   (train from #35000), and sampled K times at the training temperature on validation: the probe's records.
2. The probe (training/rewards/headroom.py) ranks every candidate cohort by its `peers` label headroom and picks the
   best cohort of three or more families; the methods follow from the pick (easyvqa_design.plan_methods).
3. Every method's runs, per seed, on the unlabelled pool (every question type, balanced, of train
   [20000, 35000)); every trained member scored greedily on easy-vqa test, balanced over question types.

Resumable: each base model and each run leaves a result file (base/<id>/base.json, runs/<run>/result.json);
a restarted experiment with the same budget skips them. Writes results.json, results.md (the tables, the
probe-vs-gain analysis, a verdict on each claim) and PNG plots. Every choice was made on validation, never on
test (docs/experiment.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from vlm_corl import cli
from vlm_corl.config.applies import renders_paraphrases
from vlm_corl.errors import UserError
from vlm_corl.experiments import easyvqa_analysis as analysis
from vlm_corl.experiments.easyvqa_data import TYPES, UNLABELLED_START, VALIDATION_START
from vlm_corl.experiments.easyvqa_design import (
    DATA,
    FULL,
    MAX_VIEWS,
    PARAPHRASED,
    QUICK,
    Budget,
    Method,
    base_recipes,
    candidates,
    cohort_records,
    plan_methods,
    probe_key,
    slug,
    views,
)


def run_name(method: Method, seed: int, part: int = 0) -> str:
    """A run's directory name (frozen peers: one run per trained member, numbered)."""
    return f"{slug(method.name)}-seed{seed}" + (f"-part{part}" if len(method.runs) > 1 else "")


def run_config(method: Method, seed: int, part: int, budget: Budget, out: Path) -> dict:
    """The cohort config of one run of a method with one seed."""
    name = run_name(method, seed, part)
    members = [
        {"id": mid, "model": str(out / "base" / base), "view": view, "trainable": trainable}
        for mid, base, view, trainable in method.runs[part]
    ]
    return {
        "name": name,
        "output_dir": str(out / "runs" / name),
        "seed": seed,
        "members": members,
        "data": {
            "train": {
                "loader": f"{DATA}:load",
                "options": {"start": UNLABELLED_START, "stop": VALIDATION_START, "balanced": True},
            },
            "batch_size": budget.batch_size,
            "seed": seed,
            # a question with fewer wordings than a view asks for: its own (set only where a slot renders a
            # paraphrase: elsewhere it would not apply, and the run would warn so)
            **({"view_fallback": "original"} if renders_paraphrases(method.mode, [m["view"] for m in members]) else {}),
        },
        "rollout": {"n": budget.rollout_n, "max_new_tokens": budget.max_new_tokens},
        "reward": {"mode": method.mode},
        "train": {
            "max_steps": budget.rl_steps,
            "lr": budget.rl_lr,
            "save_every": 0,
            "micro_batch_size": 64,
            "overwrite": True,  # an unfinished run (no result.json) is redone from its start
            "on_collapse": "warn",  # collapse is measured (the tables), not stopped
        },
        "logging": {"report_to": [], "progress": False, "category_key": "question_type"},
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


SEED_COUNTS = ("seeds", "more_seeds", "frozen_seeds", "spread_seeds")
RL_ONLY = ("rl_steps", "batch_size", "rl_lr")


def job_key(budget: Budget, split: str, kind: str) -> dict:
    """What a job's result depends on: a base model on everything but the RL settings and the seed counts, a
    run on everything but the seed counts; and the split it is scored on."""
    drop = SEED_COUNTS + (RL_ONLY if kind == "base" else ())
    return {"split": split, **{k: v for k, v in asdict(budget).items() if k not in drop}}


def finished(path: Path, key: dict) -> dict | None:
    """A job's result file, when it exists and was made with `key` (else None: the job is (re)done)."""
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return result if result.get("key") == key else None


def save_result(path: Path, result: dict, key: dict) -> dict:
    """Write a job's result file last (atomically), so a killed job leaves none."""
    result = {**result, "key": key}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result


# ---- worker jobs (spawned processes, one torch thread each) -----------------------------------------------


def eval_examples(split: str, limit: int) -> list:
    """The questions trained members are scored on: easy-vqa `test`, or `validation` (train from #35000) when
    choosing settings; both balanced over question types."""
    from vlm_corl.evaluation.scoring import EASYVQA, benchmark_examples
    from vlm_corl.experiments.easyvqa_data import validation

    return validation(limit) if split == "validation" else benchmark_examples(EASYVQA, limit)


def brief(result: dict, keep_preds: bool = False) -> dict:
    """Accuracy overall and per type, and per type how often each answer was given (the collapse check);
    `keep_preds`: every question's answer too, in question order (`constant_share` reads them)."""
    answers: dict[str, Counter] = defaultdict(Counter)
    for r in result["records"]:
        answers[r["type"]][r["pred"]] += 1
    out = {
        "accuracy": result["accuracy"],
        "by_type": result["by_type"],
        "answers": {t: dict(c.most_common()) for t, c in sorted(answers.items())},
    }
    if keep_preds:
        out["preds"] = [(r["type"], r["pred"]) for r in result["records"]]
    return out


def constant_share(evals: dict[str, dict]) -> dict[str, float]:
    """Per question type, the share of its questions on which every member (`brief`s with preds, same
    questions) gives one and the same answer, that type's most common one: how far a cohort collapsed onto a
    constant."""
    members = list(evals.values())
    by_type: dict[str, list[tuple]] = defaultdict(list)
    for j, (t, _) in enumerate(members[0]["preds"]):
        by_type[t].append(tuple(m["preds"][j][1] for m in members))
    out = {}
    for t, rows in sorted(by_type.items()):
        common = Counter(a for row in rows for a in row).most_common(1)[0][0]
        out[t] = sum(all(a == common for a in row) for row in rows) / len(rows)
    return out


def make_base(mid: str, recipe, out: Path, budget: Budget, split: str) -> dict:
    """Build one base model, score it greedily on `split` and on validation, and sample its probe records
    (K answers per validation question at the training temperature, in every view it is asked in)."""
    import torch

    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir
    from vlm_corl.models.base_models import build_base

    key = job_key(budget, split, "base")
    done = finished(out / "base.json", key)
    if done is not None:
        return done
    start = time.time()
    build = build_base(mid, recipe, out, seed=0)  # bases differ by slice and initialisation (recipe.init_seed)
    test = evaluate_dir(out, EASYVQA, eval_examples(split, budget.eval_limit), mid)
    val_examples = eval_examples("validation", budget.probe_limit)
    val = evaluate_dir(out, EASYVQA, val_examples, mid)
    sampled = dataclasses.replace(
        EASYVQA, samples=budget.rollout_n, temperature=1.0, max_new_tokens=budget.max_new_tokens
    )
    keep = ("id", "type", "pred", "preds", "gold", "correct")
    probe = {}
    for view in views(MAX_VIEWS) if mid == PARAPHRASED else ["original"]:
        torch.manual_seed(0)
        records = evaluate_dir(out, sampled, val_examples, mid, view=view)["records"]
        probe[probe_key(mid, view)] = [{k: r[k] for k in keep} for r in records]
    (out / "probe_samples.json").write_text(json.dumps(probe))
    result = {"build": build, "test": brief(test), "validation": brief(val), "seconds": round(time.time() - start, 1)}
    return save_result(out / "base.json", result, key)


def run_method(cfg_dict: dict, budget: Budget, split: str) -> dict:
    """One training run, then every trained member scored greedily on `split`; the first/last values of the
    answer-diversity metrics per trained member; the collapse warnings the run raised."""
    import torch

    from vlm_corl.config import config_from_dict
    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir
    from vlm_corl.reporting.run_plots import first_last, read_jsonl
    from vlm_corl.training.loop import run_cohort

    path = Path(cfg_dict["output_dir"]) / "result.json"
    key = {**job_key(budget, split, "run"), "config": cfg_dict}  # a changed config (easyvqa_try) is a new run
    done = finished(path, key)
    if done is not None:
        return done
    torch.set_num_threads(1)
    start = time.time()
    summary = run_cohort(config_from_dict(cfg_dict))
    examples = eval_examples(split, budget.eval_limit)
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
    result = {
        "eval": {mid: brief(evaluate_dir(final / mid, EASYVQA, examples, mid), keep_preds=True) for mid in trained},
        "diversity": diversity,
        "collapse_warnings": summary.get("collapse_warnings", []),
        "run_dir": cfg_dict["output_dir"],
        "seconds": round(time.time() - start, 1),
    }
    return save_result(path, result, key)


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


def majority_class(split: str, eval_limit: int) -> dict[str, dict]:
    """Per question type of the scored questions: the most common gold answer and its share (what answering
    one constant scores)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for ex in eval_examples(split, eval_limit):
        counts[ex.metadata["question_type"]][ex.answer] += 1
    return {
        t: {"answer": c.most_common(1)[0][0], "share": c.most_common(1)[0][1] / sum(c.values())}
        for t, c in sorted(counts.items())
    }


# ---- the probe -----------------------------------------------------------------------------------------------


def probe_all(out: Path, bases: list[str]) -> dict:
    """Every candidate cohort's probe (training/rewards/headroom.py's rank_cohorts under `peers`), from the bases'
    sampled validation records."""
    from vlm_corl.training.rewards.headroom import rank_cohorts

    records = {}
    for b in bases:
        records |= json.loads((out / "base" / b / "probe_samples.json").read_text())
    return {"ranking": rank_cohorts({name: cohort_records(c, records) for name, c in candidates().items()})}


# ---- the command --------------------------------------------------------------------------------------------


def method_record(m: Method) -> dict:
    """What results.json keeps of a method."""
    return {
        "mode": m.mode,
        "cohort": m.cohort,
        "seeds": m.seeds,
        "role": m.role,
        "tags": list(m.tags),
        "trained": m.trained,
        "runs": [[list(member) for member in run] for run in m.runs],
    }


def run_all(out: Path, budget: Budget, workers: int, split: str) -> dict:
    """Every base model, the probe, then every run of every method and seed, `workers` processes at a time,
    seed by seed (an interrupted experiment has whole seeds); members are scored on `split`."""
    start = time.time()
    recipes = base_recipes(budget)
    results = {"budget": asdict(budget), "split": split, "pool": list(TYPES), "workers": workers}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        bar = tqdm(total=len(recipes), desc="base models", unit="base", file=sys.stdout, mininterval=5)
        jobs = {mid: pool.submit(make_base, mid, r, out / "base" / mid, budget, split) for mid, r in recipes.items()}
        results["bases"] = {}
        for mid, job in jobs.items():
            results["bases"][mid] = job.result()
            bar.update()
        bar.close()
        print(f"[experiment] base models ready ({len(jobs)}) at {time.time() - start:.0f} s", flush=True)
        results["probe"] = probe_all(out, list(recipes))
        methods = plan_methods(results["probe"]["ranking"], budget)
        results["methods"] = {m.name: method_record(m) for m in methods}
        print(f"[experiment] the probe picks {methods[0].cohort}; {len(methods)} methods", flush=True)
        order = [
            (m, s, part)
            for s in range(max(m.seeds for m in methods))
            for m in methods
            if s < m.seeds
            for part in range(len(m.runs))
        ]
        bar = tqdm(total=len(order), desc="runs", unit="run", file=sys.stdout, mininterval=5)
        runs = {
            (m.name, s, part): pool.submit(run_method, run_config(m, s, part, budget, out), budget, split)
            for m, s, part in order
        }
        seeds: dict[str, dict[str, dict]] = {}
        for (name, s, part), job in runs.items():
            r = job.result()
            bar.update()
            bar.write(f"[experiment] seed {s} {name}{f' part {part}' if part else ''}: {r['seconds']} s")
            run = seeds.setdefault(str(s), {}).setdefault(
                name, {"eval": {}, "diversity": {}, "run_dirs": [], "seconds": 0.0}
            )
            run["seconds"] += r["seconds"]
            run["eval"] |= r["eval"]
            run["diversity"] |= r["diversity"]
            run["run_dirs"].append(r["run_dir"])
            run["collapse_warnings"] = run.get("collapse_warnings", []) + r["collapse_warnings"]
        bar.close()
    for methods_run in seeds.values():  # the per-question answers are only needed for this
        for run in methods_run.values():
            run["constant"] = constant_share(run["eval"])
            for e in run["eval"].values():
                e.pop("preds")
    results["seeds"] = seeds
    results["question_only"] = question_only_baseline(split, budget.eval_limit)
    results["majority"] = majority_class(split, budget.eval_limit)
    results["seconds"] = round(time.time() - start, 1)  # this invocation's (a resumed one skips finished jobs)
    # the runs' own times, whichever invocation ran them: what the training part costs on one core
    results["run_seconds"] = round(sum(m["seconds"] for s in seeds.values() for m in s.values()), 1)
    return relative_to(results, out)


def finish(out: Path, results: dict) -> None:
    """Analyse, write results.json/md (before plotting, so the tables are safe on disk), plot, write again."""
    from vlm_corl.evaluation.scoring import write_results  # torch: loaded only when there is work

    results = {**analysis.analyse(results), "plots": []}
    write_results(out, results, analysis.markdown(results))
    results["plots"] = analysis.plot_all(out, results)
    write_results(out, results, analysis.markdown(results))


def publish(out: Path, docs: Path, readme: Path | None) -> None:
    """Copy a finished experiment's results.json, results.md and plots from `out` to `docs`, and rewrite the
    summary block of `readme` (between its `<!-- easyvqa-summary: ... -->` markers) from them."""
    import shutil

    results = json.loads((out / "results.json").read_text())
    docs.mkdir(parents=True, exist_ok=True)
    for stale in docs.glob("*.png"):  # a plot an earlier version drew and this one does not
        if stale.name not in results["plots"]:
            stale.unlink()
    for name in ("results.json", "results.md", *results["plots"]):
        shutil.copyfile(out / name, docs / name)
    if readme is not None:
        try:
            text = analysis.replace_block(readme.read_text(), analysis.README_BLOCK, analysis.summary_md(results))
        except ValueError as e:
            raise UserError(f"--readme {readme}: {e}; add them where the summary table goes") from e
        readme.write_text(text)
    print(f"[experiment] published {out} to {docs}" + (f" and {readme}" if readme else ""), flush=True)


# Budget field (SEED_COUNTS): whose seeds it counts, a flag each
SEED_FLAGS = {
    "seeds": "the main comparisons, at least 2",
    "more_seeds": "the other methods",
    "frozen_seeds": "frozen peers",
    "spread_seeds": "the cohorts spread over the probe's ranking",
}


def main(argv=None) -> int:
    parser = experiment_parser()
    args = cli.parse(parser, argv)
    if args.seeds == 1:
        parser.error("--seeds must be at least 2: the main comparisons give an interval over seeds")
    out = cli.output_dir(args.out, "--out")
    if args.plots_only:
        if not (out / "results.json").is_file():
            raise UserError(
                f"--plots-only redraws a finished experiment, but {out / 'results.json'} does not exist: "
                "run the experiment into --out first"
            )
        finish(out, json.loads((out / "results.json").read_text()))
    else:
        budget = QUICK if args.quick else FULL
        given = {k: getattr(args, k) for k in (*SEED_FLAGS, "rl_steps")}
        budget = dataclasses.replace(budget, **{k: v for k, v in given.items() if v})
        finish(out, run_all(out, budget, args.workers, "validation" if args.tune else "test"))
    if args.publish:
        publish(out, Path(args.publish), Path(args.readme) if args.readme else None)
    return 0


def experiment_parser() -> argparse.ArgumentParser:
    """The experiment's flags."""
    parser = cli.parser("python -m vlm_corl.experiments.easyvqa", __doc__)
    parser.add_argument("--out", required=True, help="output directory (a finished part of an earlier run is kept)")
    parser.add_argument("--quick", action="store_true", help="a tiny budget, for smoke runs (about a minute)")
    for field_name, whose in SEED_FLAGS.items():
        parser.add_argument(
            "--" + field_name.replace("_", "-"),
            type=cli.positive_int,
            default=None,
            help=f"seeds of {whose} (default {getattr(FULL, field_name)}; {getattr(QUICK, field_name)} with --quick)",
        )
    parser.add_argument("--workers", type=cli.positive_int, default=2, help="runs in parallel (one CPU thread each)")
    parser.add_argument(
        "--rl-steps",
        type=cli.positive_int,
        default=None,
        help=f"RL steps of every method (default {FULL.rl_steps})",
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
    parser.add_argument(
        "--publish",
        default=None,
        metavar="DIR",
        help="afterwards, copy results.json/md and the plots to DIR (docs/easyvqa) and rewrite --readme's summary",
    )
    parser.add_argument(
        "--readme",
        default="docs/experiment.md",
        help="the page whose easyvqa-summary block --publish rewrites ('' = none)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(cli.run(main))

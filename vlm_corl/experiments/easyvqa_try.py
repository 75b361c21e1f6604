"""One method of the easy-vqa experiment, run once with changed settings and scored on validation, for choosing
settings without rebuilding the base models (and never looking at test).

    python -m vlm_corl.experiments.easyvqa_try --bases DIR --method SLUG [--seed 0] [--limit 600] [--out DIR]
        [KEY=VALUE ...]

--bases: the `base` folder of an experiment whose base models are built (`python -m vlm_corl.experiments.easyvqa
--out X` writes X/base); the methods are the ones that experiment plans from its probe (`--method list` prints
them). KEY=VALUE: dotted overrides of every run's cohort config, e.g. rollout.n=8 data.batch_size=64
reward.vote_threshold=0.75 train.lr=1e-3 train.max_steps=240. Prints one JSON line: the run's seconds and, per
trained member, balanced and per-type validation accuracy of its base model and after training, the change in
points, and the cohort's mean change (the numbers of the README's "what was tried" table).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import config_from_dict
from vlm_corl.config.parse import Problems, apply_override
from vlm_corl.errors import UserError
from vlm_corl.experiments.easyvqa import eval_examples, probe_all, run_config, run_method
from vlm_corl.experiments.easyvqa_design import FULL, Method, base_recipes, plan_methods, slug


def planned_methods(bases: Path) -> dict[str, Method]:
    """{slug: method} of the experiment whose base models are in `bases`, as it plans them from its probe."""
    missing = sorted(b for b in base_recipes(FULL) if not (bases / b / "probe_samples.json").is_file())
    if missing:
        raise UserError(
            f"--bases {bases}: no built base model {', '.join(missing)} there (a model folder with "
            "probe_samples.json): give the base folder of a `corl experiment --out DIR` run "
            "(DIR/base) whose base models are built"
        )
    ranking = probe_all(bases.parent, list(base_recipes(FULL)))["ranking"]
    return {slug(m.name): m for m in plan_methods(ranking, FULL)}


def try_configs(method: Method, bases: Path, seed: int, out: Path, overrides: list[str]) -> list[dict]:
    """The cohort configs of `method`'s runs at the experiment's budget, on the base models in `bases`, with
    the dotted `overrides` applied; a bad override or value is a ConfigError naming it."""
    configs = []
    for part in range(len(method.runs)):
        cfg = run_config(method, seed, part, FULL, out)
        for member in cfg["members"]:
            member["model"] = str(bases / Path(member["model"]).name)
        problems = Problems()
        for text in overrides:
            apply_override(cfg, text, problems)
        if problems.items:
            raise problems.error()
        config_from_dict(cfg)  # every value checked now, before the base models are scored
        configs.append(cfg)
    return configs


def score(evals: dict, seconds: float, base_scores: dict) -> dict:
    """Per trained member: base and after (balanced and per type), the change in points; the cohort's mean."""
    members = {}
    for mid, after in evals.items():
        before = base_scores[mid]
        members[mid] = {
            "base": {"balanced": before["accuracy"], **before["by_type"]},
            "after": {"balanced": after["accuracy"], **after["by_type"]},
            "change_points": round(100 * (after["accuracy"] - before["accuracy"]), 2),
        }
    cohort = statistics.fmean(m["change_points"] for m in members.values())
    return {"seconds": seconds, "members": members, "cohort_change_points": round(cohort, 2)}


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.experiments.easyvqa_try", __doc__)
    parser.add_argument("--bases", required=True, help="the base folder of an experiment (OUT/base)")
    parser.add_argument("--method", required=True, help="a method's slug, or `list` to print them")
    parser.add_argument("--seed", type=int, default=0, help="the RL seed (sampling and data order)")
    parser.add_argument("--limit", type=cli.positive_int, default=600, help="validation questions, balanced by type")
    parser.add_argument("--out", default="out/easyvqa_try", help="where the run directories go")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the runs' cohort configs")
    args = cli.parse(parser, argv)
    bases = Path(args.bases)
    methods = planned_methods(bases)
    if args.method == "list":
        print("\n".join(f"{s}\t{m.name}" for s, m in methods.items()))
        return 0
    if args.method not in methods:
        raise UserError(f"--method {args.method!r} is not a method of the experiment; one of: {', '.join(methods)}")
    method = methods[args.method]
    configs = try_configs(method, bases, args.seed, cli.output_dir(args.out, "--out"), args.overrides)

    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir

    examples = eval_examples("validation", args.limit)
    base_scores = {mid: evaluate_dir(bases / base, EASYVQA, examples, mid) for mid, base in method.trained.items()}
    budget = dataclasses.replace(FULL, eval_limit=args.limit)
    evals, seconds = {}, 0.0
    for cfg in configs:
        run = run_method(cfg, budget, "validation")
        evals |= run["eval"]
        seconds += run["seconds"]
    result = score(evals, round(seconds, 1), base_scores)
    print(json.dumps({"method": method.name, "seed": args.seed, "overrides": args.overrides, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))

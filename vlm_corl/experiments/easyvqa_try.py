"""One method of the easy-vqa experiment, run once with changed settings and scored on validation, for choosing
settings without rebuilding the base models (and never looking at test).

    python -m vlm_corl.experiments.easyvqa_try --bases DIR --method SLUG [--seed 0] [--limit 600] [--out DIR]
        [KEY=VALUE ...]

--bases: the `base` folder of a finished experiment (`python -m vlm_corl.experiments.easyvqa --out X` writes
X/base with A, B, A2, B2 and M). --method: a method's slug (`--method list` prints them). KEY=VALUE: dotted
overrides of the run's cohort config, e.g. rollout.n=8 data.batch_size=64 reward.vote_threshold=0.75
train.lr=1e-3 train.max_steps=240. Prints one JSON line: the run's seconds and, per trained member, balanced
and per-type validation accuracy of its base model and after training, the change in points, and the cohort's
mean change (the numbers of the README's "what was tried" table).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import config_from_dict
from vlm_corl.config.parse import Problems, apply_override
from vlm_corl.errors import UserError
from vlm_corl.experiments.easyvqa import FULL, METHODS, eval_examples, method_config, run_method, slug

SLUGS = {slug(m): m for m in METHODS}


def try_config(method: str, bases: Path, seed: int, out: Path, overrides: list[str]) -> dict:
    """The cohort config of `method` at the experiment's budget, on the base models in `bases`, with the
    dotted `overrides` applied; a bad override or value is a ConfigError naming it."""
    members = {base for _, base, _ in METHODS[method][0]}
    missing = sorted(b for b in members if not (bases / b / "config.json").is_file())
    if missing:
        raise UserError(
            f"--bases {bases}: no base model {', '.join(missing)} there (a model folder with config.json): "
            "give the base folder of a finished `python -m vlm_corl.experiments.easyvqa --out DIR` run (DIR/base)"
        )
    cfg = method_config(method, seed, FULL, out)
    for member in cfg["members"]:
        member["model"] = str(bases / Path(member["model"]).name)
    problems = Problems()
    for text in overrides:
        apply_override(cfg, text, problems)
    if problems.items:
        raise problems.error()
    config_from_dict(cfg)  # every value checked now, before the base models are scored
    return cfg


def score(run: dict, base_scores: dict) -> dict:
    """Per trained member: base and after (balanced and per type), the change in points; the cohort's mean."""
    members = {}
    for mid, after in run["eval"].items():
        before = base_scores[mid]
        members[mid] = {
            "base": {"balanced": before["accuracy"], **before["by_type"]},
            "after": {"balanced": after["accuracy"], **after["by_type"]},
            "change_points": round(100 * (after["accuracy"] - before["accuracy"]), 2),
        }
    cohort = statistics.fmean(m["change_points"] for m in members.values())
    return {"seconds": run["seconds"], "members": members, "cohort_change_points": round(cohort, 2)}


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.experiments.easyvqa_try", __doc__)
    parser.add_argument("--bases", required=True, help="the base folder of a finished experiment (OUT/base)")
    parser.add_argument("--method", required=True, help="a method's slug, or `list` to print them")
    parser.add_argument("--seed", type=int, default=0, help="the RL seed (sampling and data order)")
    parser.add_argument("--limit", type=cli.positive_int, default=600, help="validation questions, balanced by type")
    parser.add_argument("--out", default="out/easyvqa_try", help="where the run directory goes")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the run's cohort config")
    args = parser.parse_args(argv)
    if args.method == "list":
        print("\n".join(f"{s}\t{m}" for s, m in SLUGS.items()))
        return 0
    if args.method not in SLUGS:
        raise UserError(f"--method {args.method!r} is not a method of the experiment; one of: {', '.join(SLUGS)}")
    method = SLUGS[args.method]
    cfg = try_config(method, Path(args.bases), args.seed, cli.output_dir(args.out, "--out"), args.overrides)

    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir

    examples = eval_examples("validation", args.limit)
    base_scores = {
        m["id"]: evaluate_dir(m["model"], EASYVQA, examples, m["id"])
        for m in cfg["members"]
        if m.get("trainable", True)
    }
    run = run_method(cfg, args.limit, "validation")
    print(json.dumps({"method": method, "seed": args.seed, "overrides": args.overrides, **score(run, base_scores)}))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))

"""The demo (the README's first command): four tiny vision-language members learn easy-vqa from each other's
votes, without labels, on two processes.

    python -m vlm_corl.demo [--seed 0] [--processes 2] [--eval-limit 600] [--rebuild-base] [dotted.key=value ...]

1. base models: the shipped ones (vlm_corl/demo_bases/, copied to the paths the config names), or with
   --rebuild-base built again: zoo member -> supervised warm start on its own labelled slice of easy-vqa train
   (the stand-in for a pretrained checkpoint; the only step that reads labels);
2. score them on easy-vqa test (balanced over yes/no, shape and colour questions), greedily;
3. label-free Co-RL: the config's cohort (`peers_ema`, the experiment's most robust gain), its members spread
   over --processes processes (torchrun), on train questions disjoint from the labelled slices;
4. score the trained members the same way;
5. before -> after per member and question type, the collapse flags, and the cohort's gain in points, printed
   and written to out/demo/demo.json. A question type on which a member answers one constant to at least 90 % of
   the questions has collapsed: its gain there counts as none (as in the experiment, docs/experiment.md).

Reproducible numbers: before torch loads, the demo pins what makes two x86-64 machines compute differently:
one thread per process (a reduction's order) and the CPU kernels (`PINNED_KERNELS`: torch's own vectorised
kernels and oneDNN's at AVX2, MKL's conditional-reproducibility branch at AVX2), which otherwise follow the
CPU's features (AVX-512 here) and change the base models' weights within 60 warm-start steps. The shipped base
models do not depend on the machine at all. `--publish DIR` records the run as DIR/demo-seed<S>.json and
rewrites the README's table from every seed recorded there (a test keeps the two equal).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import ConfigError, load_config, read_raw_config
from vlm_corl.errors import UserError

# torch and transformers load in the functions that train and evaluate (after `main` has parsed its arguments
# and pinned the kernels): `--help` and argument mistakes answer at once

SHIPPED_BASES = Path(__file__).resolve().parents[1] / "demo_bases"  # the four base models, ~1 MB each
TYPES = ("yes/no", "shape", "color")
# Set before torch loads, in this process and every one it starts (children inherit the environment).
PINNED_KERNELS = {
    "OMP_NUM_THREADS": "1",  # one thread per process: the two processes share two cores
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's vectorised kernels (softmax, reductions, ...)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's (the vision tower's patch convolution, ...)
    "MKL_CBWR": "AVX2",  # MKL's matrix products: one code branch on every AVX2 CPU
}
README_BLOCK = "demo-results"


def main(argv=None) -> int:
    args = cli.parse(demo_parser(), argv)
    os.environ.update(PINNED_KERNELS)  # before torch loads
    start = time.time()
    overrides = [f"seed={args.seed}", f"data.seed={args.seed}", *args.overrides]
    members = config_members(args.config, overrides)
    recipes = base_recipes(members, args.warm_steps)
    check_config(args.config, overrides, members)  # every mistake in the config before minutes of work
    out = cli.output_dir(args.out, "--out")
    report, where = run_demo(args, overrides, members, recipes)
    report |= {"seed": args.seed, "processes": args.processes, **where, "seconds": round(time.time() - start, 1)}
    report["machine"] = machine()
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    _header("5. before -> after label-free Co-RL")
    print(describe(report))
    print(f"run directory: {report['run_dir']}   (details in {out / 'demo.json'})")
    if args.publish:
        print(f"published: {publish(report, Path(args.publish), Path('README.md'))}")
    return 0


def demo_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = cli.parser("python -m vlm_corl.demo", __doc__)
    parser.add_argument("--config", default="configs/cohorts/tiny_easyvqa.yaml")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="the run's seed (sampling, data order)")
    parser.add_argument(
        "--processes", type=cli.positive_int, default=2, help="processes the members are spread over (default 2)"
    )
    parser.add_argument(
        "--eval-limit", type=cli.positive_int, default=600, help="easy-vqa test questions (balanced by type)"
    )
    parser.add_argument(
        "--rebuild-base",
        action="store_true",
        help="build the base models again (zoo + supervised warm start, a few minutes) instead of the shipped ones",
    )
    parser.add_argument(
        "--warm-steps",
        type=cli.positive_int,
        default=None,
        help="with --rebuild-base: warm-start steps of every base model instead of the recipes' (smoke runs)",
    )
    parser.add_argument("--out", default="out/demo", help="where demo.json goes (default out/demo)")
    parser.add_argument(
        "--publish", default=None, metavar="DIR", help="also record the run as DIR/demo-seed<S>.json and rewrite "
        "the README's demo table from every seed recorded there (e.g. docs/demo)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the cohort config")
    return parser


def run_demo(
    args: argparse.Namespace, overrides: list[str], members: dict[str, str], recipes: dict
) -> tuple[dict, dict]:
    """Steps 1-4: the base models, their scores, the label-free training, the trained members' scores; the
    report of before -> after (`demo_report`), and where the run, its last checkpoint and the base models are."""
    # One pool of worker processes (one torch thread each) builds and scores the members; started once, it
    # waits idle while the training processes run.
    with ProcessPoolExecutor(args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        _header(f"1. base models of {', '.join(members)}")
        base = make_bases(members, recipes, args.rebuild_base, pool)
        cfg = load_config(args.config, overrides)

        _header(f"2. base models on easy-vqa test ({args.eval_limit} questions, balanced by type)")
        before = evaluate_all({m.id: m.model for m in cfg.members}, args.eval_limit, pool)

        _header(
            f"3. label-free Co-RL: {cfg.reward.mode} rewards, {cfg.train.max_steps} steps, {cfg.data.batch_size} "
            f"questions x {cfg.rollout.n} samples per step, {len(cfg.members)} members on {args.processes} "
            "process(es)"
        )
        summary = train_cohort(args.config, overrides, args.processes)
        final = Path(summary["checkpoint"])

        _header("4. trained members on easy-vqa test")
        after = evaluate_all({m.id: final / m.id for m in cfg.members}, args.eval_limit, pool)

    where = {"run_dir": summary["run_dir"], "checkpoint": str(final), "base_models": base}
    return demo_report(before, after, args.eval_limit), where


# ---- 1. base models --------------------------------------------------------------------------------------------


def base_recipes(members: dict[str, str], warm_steps: int | None) -> dict:
    """{member id: its BaseRecipe}: the easy-vqa experiment's recipe of the base of that name."""
    from dataclasses import replace

    from vlm_corl.experiments.easyvqa_design import FULL
    from vlm_corl.experiments.easyvqa_design import base_recipes as experiment_recipes

    known = experiment_recipes(FULL)
    unknown = sorted(set(members) - set(known))
    if unknown:
        raise UserError(f"the demo has no base-model recipe for members {unknown}; known: {sorted(known)}")
    return {mid: replace(known[mid], steps=warm_steps or known[mid].steps) for mid in members}


def make_bases(members: dict[str, str], recipes: dict, rebuild: bool, pool: Executor) -> dict:
    """Put each member's base model where the config names it: the shipped copy, or (`rebuild`) one built again
    by the worker processes of `pool`. Returns what was done per member."""
    if not rebuild:
        done = {}
        for mid, path in members.items():
            if not (SHIPPED_BASES / mid / "config.json").is_file():
                raise UserError(f"no shipped base model for member {mid!r} in {SHIPPED_BASES}; use --rebuild-base")
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(SHIPPED_BASES / mid, path)
            done[mid] = {"shipped": str(SHIPPED_BASES.relative_to(SHIPPED_BASES.parents[1]) / mid)}
            print(f"  {mid}: the shipped base model -> {path}", flush=True)
        return done
    from vlm_corl.models.base_models import build_base

    for mid, r in recipes.items():
        print(
            f"  {mid}: {r.family} ({r.size}), {r.slice_size} labelled questions from #{r.slice_start}, "
            f"{r.steps} steps at lr {r.lr}",
            flush=True,
        )
    jobs = {mid: pool.submit(build_base, mid, recipes[mid], Path(path), 0) for mid, path in members.items()}
    built = {mid: job.result() for mid, job in jobs.items()}
    for mid, b in built.items():
        print(f"  {mid}: loss {b['first_loss']:.3f} -> {b['last_loss']:.3f} in {b['seconds']} s", flush=True)
    return built


# ---- 2 and 4. scoring --------------------------------------------------------------------------------------------


def evaluate_all(models: dict[str, Path], limit: int, pool: Executor) -> dict[str, dict]:
    """Score each model directory greedily on easy-vqa test, by the worker processes of `pool`; one line per
    model. Returns {member id: accuracy overall and per type, and the answers given per type}."""
    jobs = {mid: pool.submit(score_model, mid, str(path), limit) for mid, path in models.items()}
    results = {mid: job.result() for mid, job in jobs.items()}
    for mid, r in results.items():
        types = ", ".join(f"{t} {r['by_type'][t]:.3f}" for t in TYPES)
        print(f"  {mid}: {r['accuracy']:.3f}  ({types})", flush=True)
    return results


def score_model(mid: str, path: str, limit: int) -> dict:
    """One model on the first `limit` balanced easy-vqa test questions (a worker process's job)."""
    import torch

    from vlm_corl.evaluation.scoring import EASYVQA, evaluate_dir
    from vlm_corl.experiments.easyvqa import brief, eval_examples

    cli.quiet_library_bars()  # a spawned worker starts with transformers' defaults
    torch.set_num_threads(1)
    return brief(evaluate_dir(Path(path), EASYVQA, eval_examples("test", limit), mid))


# ---- 3. training ----------------------------------------------------------------------------------------------


def train_cohort(config: str, overrides: list[str], processes: int) -> dict:
    """Train the cohort on `processes` processes (torchrun; this process when 1); returns the run's summary."""
    if processes == 1:
        from vlm_corl.api import CohortTrainer

        return CohortTrainer(config, overrides=overrides).train()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "vlm_corl.train", "--config", config, *overrides]  # fmt: skip
    done = subprocess.run(command, stdout=subprocess.DEVNULL)  # its summary is read from the run directory
    if done.returncode != 0:
        raise UserError(f"training stopped with exit status {done.returncode} (its messages are above)")
    run_dir = Path(load_config(config, overrides).output_dir)
    return json.loads((run_dir / "summary.json").read_text())


# ---- 5. the result -------------------------------------------------------------------------------------------


def demo_report(before: dict, after: dict, limit: int) -> dict:
    """Per member before/after (overall, per type, collapse flags, gain) and the cohort's gain in points: the
    mean over members of the change in balanced accuracy, a collapsed type's change counted as min(change, 0)
    (vlm_corl.experiments.easyvqa_analysis.member_deltas, as in the experiment)."""
    from vlm_corl.experiments.easyvqa import majority_class
    from vlm_corl.experiments.easyvqa_analysis import member_deltas

    majority = majority_class("test", limit)
    members = {}
    for mid in before:
        d = member_deltas(after[mid], before[mid], majority)
        members[mid] = {
            "before": {"accuracy": before[mid]["accuracy"], "by_type": before[mid]["by_type"]},
            "after": {"accuracy": after[mid]["accuracy"], "by_type": after[mid]["by_type"]},
            "collapsed": [t for t in TYPES if d[f"collapsed_{t}"]],
            "gain_points": round(100 * d["gain"], 2),
            "delta_points": round(100 * d["d_accuracy"], 2),
            "answers_after": after[mid]["answers"],
        }
    return {
        "gain_points": round(statistics.fmean(m["gain_points"] for m in members.values()), 2),
        "delta_points": round(statistics.fmean(m["delta_points"] for m in members.values()), 2),
        "eval_questions": limit,
        "members": members,
    }


def describe(report: dict) -> str:
    """The printed result: per member before -> after overall and per type, collapses, and the cohort's gain."""
    lines = [f"easy-vqa test accuracy ({report['eval_questions']} questions, balanced by type):"]
    for mid, m in report["members"].items():
        types = ", ".join(f"{t} {m['before']['by_type'][t]:.3f}->{m['after']['by_type'][t]:.3f}" for t in TYPES)
        flags = f"  collapsed: {', '.join(m['collapsed'])}" if m["collapsed"] else ""
        lines.append(
            f"  {mid:11s} {m['before']['accuracy']:.3f} -> {m['after']['accuracy']:.3f}  gain {m['gain_points']:+.1f}"
            f"   ({types}){flags}"
        )
    lines.append(
        f"cohort gain: {report['gain_points']:+.2f} points (mean over members; a collapsed type counts as no gain; "
        f"change in balanced accuracy {report['delta_points']:+.2f})"
    )
    return "\n".join(lines)


def machine() -> dict:
    """What the numbers were computed on: CPU model, torch's kernel level, threads, the pinned settings."""
    import platform

    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "pinned": {k: os.environ.get(k) for k in PINNED_KERNELS},
    }


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def publish(report: dict, folder: Path, readme: Path) -> Path:
    """Record `report` as folder/demo-seed<S>.json and rewrite the README's demo table from every recorded seed."""
    from vlm_corl.experiments.easyvqa_analysis import replace_block

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"demo-seed{report['seed']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    readme.write_text(replace_block(readme.read_text(), README_BLOCK, readme_table(load_seeds(folder))))
    return path


def load_seeds(folder: Path) -> list[dict]:
    """The recorded demo runs in `folder`, by seed."""
    runs = [json.loads(p.read_text()) for p in folder.glob("demo-seed*.json")]
    return sorted(runs, key=lambda r: r["seed"])


def readme_table(runs: list[dict]) -> str:
    """The README's block: the first recorded seed's table (what `make demo` prints) and the band over seeds."""
    first = runs[0]
    gains = [r["gain_points"] for r in runs]
    band = (
        f"over seeds {', '.join(str(r['seed']) for r in runs)}: {min(gains):+.1f} to {max(gains):+.1f} points, mean "
        f"{statistics.fmean(gains):+.1f}"
    )
    rows = [
        "| member | before | after | gain (points) | yes/no | shape | colour | collapsed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mid, m in first["members"].items():
        types = " | ".join(f"{m['before']['by_type'][t]:.3f} → {m['after']['by_type'][t]:.3f}" for t in TYPES)
        rows.append(
            f"| {mid} | {m['before']['accuracy']:.3f} | {m['after']['accuracy']:.3f} | {m['gain_points']:+.1f} | "
            f"{types} | {', '.join(m['collapsed']) or '-'} |"
        )
    mach = first["machine"]
    return "\n".join([
        f"Seed {first['seed']} (`make demo`), {first['eval_questions']} easy-vqa test questions balanced by type, on "
        f"{mach['cpu']} ({mach['cores']} cores, {first['processes']} processes, {first['seconds']:.0f} s):",
        "",
        *rows,
        "",
        f"**Cohort gain {first['gain_points']:+.1f} points**; the band {band} (from `docs/demo/`, written by "
        "`corl demo --seed S --publish docs/demo`).",
        "",
    ])  # fmt: skip


# ---- checks ----------------------------------------------------------------------------------------------------


def _header(text: str) -> None:
    print(f"\n[demo] {text}", flush=True)


def config_members(path: str, overrides: list[str]) -> dict[str, str]:
    """{member id: model path} straight from the YAML (before validation, which needs the models to exist)."""
    members = read_raw_config(path, overrides).get("members")
    if not isinstance(members, list) or not all(isinstance(m, dict) and "id" in m and "model" in m for m in members):
        raise ConfigError([f"{path}: members must be a list of {{id, model}} mappings"], ["members"])
    return {str(m["id"]): str(m["model"]) for m in members}


def check_config(path: str, overrides: list[str], to_build: dict[str, str]) -> None:
    """Every problem of the cohort config except the model directories the demo is about to put in place."""
    try:
        load_config(path, overrides)
    except ConfigError as err:
        built = {f"members[{i}].model" for i, mid in enumerate(config_members(path, overrides)) if mid in to_build}
        rest = [(f, p) for f, p in zip(err.fields, err.problems) if f not in built]
        if rest:
            raise ConfigError([p for _, p in rest], [f for f, _ in rest]) from None


if __name__ == "__main__":
    sys.exit(cli.run(main))

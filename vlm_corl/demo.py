"""The demo (the README's first command): a diverse tiny cohort learns easy-vqa from its peers, without labels.

    python -m vlm_corl.demo [--config configs/cohorts/tiny_easyvqa.yaml] [--eval-limit 600]

1. zoo: build the randomly initialised members (offline);
2. base models: a short supervised warm start of each member on its own small labelled slice of easy-vqa
   train (the stand-in for a pretrained checkpoint; the only step that reads labels);
3. evaluate the base models on easy-vqa test (balanced over yes/no, shape and colour questions);
4. Co-RL: train the cohort of the config (ring peer rewards, train questions disjoint from the slices);
5. evaluate the trained members the same way, and print before/after.
Everything goes under out/demo/ and the run directory of the config.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import ConfigError, MemberConfig, load_config, read_raw_config
from vlm_corl.errors import UserError
from vlm_corl.registry import BENCHMARKS, FAMILIES
from vlm_corl.warmstart import labelled_slice, warm_start
from vlm_corl.zoo import build_member

# torch and transformers load in the functions that train and evaluate (after `main` has parsed its arguments):
# `--help` and argument mistakes answer at once


@dataclass(frozen=True)
class BaseRecipe:
    """How the demo makes a member's base model: zoo family/size, a labelled slice of easy-vqa train
    (balanced over question types, or over metadata[balance] in the shares of `mix`, starting at `slice_start`),
    and the supervised warm start."""

    family: str
    size: str
    slice_start: int
    slice_size: int
    steps: int
    lr: float = 2e-3
    batch_size: int = 32
    init_seed: int = 0  # added to the run seed for the zoo initialisation (two members of one family differ)
    # ((value of metadata[balance], share), ...) of the labelled slice; None = balanced over those values
    mix: tuple[tuple[str, float], ...] | None = None
    balance: str = "question_type"
    loader: str = "easyvqa"  # a loader registry name or module:function (vlm_corl.data.loaders)


# Different labelled slices per member (warm-start data diversity lowers the correlation of their errors),
# both before question 20000, where the cohort's unlabelled training questions start. Steps and learning
# rates were chosen on a validation split carved from the end of easy-vqa train (never on test): Mllama reads
# the image through zero-initialised gated cross-attention and needs the larger rate to start using it.
RECIPES = {
    "qwen": BaseRecipe("qwen2_vl", "tiny", 0, 1000, steps=1000),
    "llama": BaseRecipe("mllama", "tiny", 10000, 1000, steps=1000, lr=4e-3),
}


def build_base(member_id: str, recipe: BaseRecipe, out: Path, seed: int, bar_position: int | None = None) -> dict:
    """Zoo member -> warm start on its labelled slice -> saved at `out` (the path the cohort config names).
    `bar_position`: show a warm-start progress bar (on a terminal) on that line."""
    import torch
    from tqdm import tqdm

    from vlm_corl.members.member import load_member

    torch.set_num_threads(1)  # one thread per worker: the two warm starts share the machine's cores
    cli.quiet_library_bars()  # a spawned worker starts with transformers' defaults
    init = seed + recipe.init_seed
    # One directory per initialisation: parallel workers never write a zoo member another one is reading.
    zoo_dir = out.parent.parent / "zoo" / f"{recipe.family}-{recipe.size}-init{init}"
    build_member(FAMILIES.get(recipe.family), zoo_dir, size=recipe.size, seed=init)
    examples = labelled_slice(
        recipe.loader,
        None,
        "train",
        recipe.slice_start,
        recipe.slice_size,
        recipe.balance,
        dict(recipe.mix) if recipe.mix else None,
    )
    torch.manual_seed(seed)
    member = load_member(MemberConfig(id=member_id, model=str(zoo_dir)))
    start = time.time()
    with tqdm(
        total=recipe.steps,
        desc=f"warm start {member_id}",
        unit="step",
        position=bar_position,
        disable=None if bar_position is not None else True,
    ) as bar:
        losses = warm_start(
            member, examples, recipe.steps, recipe.batch_size, recipe.lr, seed, on_step=lambda loss: bar.update()
        )
    member.save(out)
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": recipe.steps,
        "examples": len(examples),
        "seconds": round(time.time() - start, 1),
    }


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.demo", __doc__)
    parser.add_argument("--config", default="configs/cohorts/tiny_easyvqa.yaml")
    parser.add_argument(
        "--eval-limit", type=cli.positive_int, default=600, help="easy-vqa test questions (balanced by type)"
    )
    parser.add_argument(
        "--reuse-base",
        action="store_true",
        help="keep base models already built by an earlier demo run (skip steps 1-2)",
    )
    parser.add_argument(
        "--warm-steps",
        type=cli.positive_int,
        default=None,
        help="warm-start steps of every base model instead of the recipes' (for smoke runs)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the cohort config")
    args = cli.parse(parser, argv)
    import torch

    from vlm_corl.evaluation.scoring import benchmark_examples

    recipes = {mid: replace(r, steps=args.warm_steps or r.steps) for mid, r in RECIPES.items()}
    start = time.time()
    overrides = ["train.overwrite=true", *args.overrides]  # the demo redoes its run
    members = config_members(args.config, overrides)
    unknown = sorted(set(members) - set(RECIPES))
    if unknown:
        raise UserError(f"the demo has no base-model recipe for members {unknown}; known: {sorted(RECIPES)}")
    todo = {
        mid: path for mid, path in members.items() if not (args.reuse_base and (Path(path) / "config.json").is_file())
    }
    check_config(args.config, overrides, todo)  # every mistake in the config before minutes of warm start
    bench = BENCHMARKS.get("easyvqa")
    examples = benchmark_examples(bench, args.eval_limit)

    _header(f"1-2. base models: zoo + supervised warm start of {', '.join(todo) or 'none (reused)'}")
    for mid in todo:
        r = recipes[mid]
        print(
            f"  {mid}: {r.family} ({r.size}), {r.slice_size} labelled questions from #{r.slice_start}, "
            f"{r.steps} steps at lr {r.lr}",
            flush=True,
        )
    with ProcessPoolExecutor(max(len(todo), 1), mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = {
            mid: pool.submit(build_base, mid, recipes[mid], Path(path), 0, i)
            for i, (mid, path) in enumerate(todo.items())
        }
        base = {mid: job.result() for mid, job in jobs.items()}
    for mid, b in base.items():
        print(f"  {mid}: loss {b['first_loss']:.3f} -> {b['last_loss']:.3f} in {b['seconds']} s", flush=True)
    cfg = load_config(args.config, overrides)

    _header(f"3. base models on easy-vqa test ({len(examples)} questions, balanced by type)")
    before = evaluate_all({m.id: m.model for m in cfg.members}, bench, examples)

    from vlm_corl.training.loop import run_cohort

    _header(
        f"4. label-free Co-RL: {cfg.reward.mode} rewards, {cfg.train.max_steps} steps, "
        f"{cfg.data.batch_size} questions x {cfg.rollout.n} samples per step"
    )
    summary = run_cohort(cfg)
    final = Path(summary["checkpoint"])
    _header("5. trained members on easy-vqa test")
    after = evaluate_all({m.id: final / m.id for m in cfg.members}, bench, examples)

    report = {
        "run_dir": summary["run_dir"],
        "checkpoint": str(final),
        "eval_questions": len(examples),
        "base_models": base,
        "seconds": round(time.time() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "members": {mid: {"before": _brief(before[mid]), "after": _brief(after[mid])} for mid in before},
    }
    out = Path("out/demo")
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(report, indent=2))
    print(f"\neasy-vqa test accuracy ({len(examples)} questions, balanced by type), before -> after label-free Co-RL:")
    for mid, r in report["members"].items():
        types = ", ".join(
            f"{t} {r['before']['by_type'][t]:.3f}->{r['after']['by_type'][t]:.3f}" for t in r["before"]["by_type"]
        )
        print(f"  {mid:6s} {r['before']['accuracy']:.3f} -> {r['after']['accuracy']:.3f}   ({types})")
    print(
        f"run directory: {summary['run_dir']}   (total {report['seconds']} s, {report['torch_threads']} torch "
        "threads; details in out/demo/demo.json)"
    )
    return 0


def evaluate_all(models: dict[str, Path], bench, examples) -> dict[str, dict]:
    """Evaluate each model directory, one line per model as it finishes."""
    from vlm_corl.evaluation.scoring import evaluate_dir

    results = {}
    for mid, path in models.items():
        results[mid] = evaluate_dir(path, bench, examples, mid, progress=True)
        types = ", ".join(f"{t} {a:.3f}" for t, a in results[mid]["by_type"].items())
        print(f"  {mid}: {results[mid]['accuracy']:.3f}  ({types})", flush=True)
    return results


def _header(text: str) -> None:
    print(f"\n[demo] {text}", flush=True)


def _brief(result: dict) -> dict:
    return {"accuracy": result["accuracy"], "by_type": result["by_type"]}


def config_members(path: str, overrides: list[str]) -> dict[str, str]:
    """{member id: model path} straight from the YAML (before validation, which needs the models to exist)."""
    members = read_raw_config(path, overrides).get("members")
    if not isinstance(members, list) or not all(isinstance(m, dict) and "id" in m and "model" in m for m in members):
        raise ConfigError([f"{path}: members must be a list of {{id, model}} mappings"], ["members"])
    return {str(m["id"]): str(m["model"]) for m in members}


def check_config(path: str, overrides: list[str], to_build: dict[str, str]) -> None:
    """Every problem of the cohort config except the model directories the demo is about to build."""
    try:
        load_config(path, overrides)
    except ConfigError as err:
        built = {f"members[{i}].model" for i, mid in enumerate(config_members(path, overrides)) if mid in to_build}
        rest = [(f, p) for f, p in zip(err.fields, err.problems) if f not in built]
        if rest:
            raise ConfigError([p for _, p in rest], [f for f, _ in rest]) from None


if __name__ == "__main__":
    sys.exit(cli.run(main))

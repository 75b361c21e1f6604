"""Know before launching whether a cohort fits: `python -m vlm_corl.plan --config COHORT.yaml [--nodes 1]
[--gpus-per-node 8] [--gpu-memory 80GB] [--json] [--suggest] [dotted.key=value ...]`.

For every rank, every member it hosts and the total: weights, gradients, optimizer state, full copies, KL
reference, EMA teacher, frozen peers, DeepSpeed's buffers, the vLLM engine's weights and KV cache, the HF
rollout's KV cache, and an update's activations and logits; the peak against the card, a verdict, and the
changes that would make it fit, each with the memory it saves. `--suggest` searches the cheapest layout that
fits and prints it as lines for the cohort file. No weights are read: parameter counts come from each member's
config.json on the `meta` device (vlm_corl.planning); a member whose model directory is not downloaded yet but
is named like a released architecture under configs/models/ (its directory, or the repository models.json
records) is planned from that config.json (said on stderr); one that names none exits 2 naming configs/models.
A member of a family we do not register is planned through the generic family, or refused (exit 2) saying why.
Beside the GPUs: the host memory of every node and the disk the checkpoints take. Exit 0 with the plan, 2 on a bad
config or argument.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import ConfigError, load_config, read_raw_config
from vlm_corl.errors import UserError
from vlm_corl.members.memory import GB, memory_size


def released_stand_ins(config: str, overrides: Sequence[str]) -> list[str]:
    """Overrides that plan a member whose model directory does not exist yet from the released architecture it
    names under configs/models/ (config.json only: the planner reads no weights), each said on stderr. A missing
    model that names none is a UserError naming configs/models as the way."""
    from vlm_corl.planning.tables import MODELS

    out, unknown = [], []
    for i, m in enumerate(read_raw_config(config, overrides).get("members") or []):
        model = str(m.get("model", "")) if isinstance(m, dict) else ""
        if not model or Path(model).exists():
            continue
        found = released_config(model, MODELS)
        if found is None:
            unknown.append(f"members[{i}].model {model}")
            continue
        released, how = found
        out.append(f"members.{i}.model={released}")
        print(f"note: members[{i}].model {model} does not exist: planned with {released} ({how})", file=sys.stderr)
    if unknown:
        known = ", ".join(sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file()))
        raise UserError(
            f"{config}: {'; '.join(unknown)} does not exist and names no released architecture under "
            f"{MODELS} ({known}). To plan before downloading, name the member's directory like one of those "
            "(or its Hugging Face repository, as models.json lists it), or add the model's config.json as "
            "configs/models/NAME/config.json with its repository in configs/models/models.json. A tiny model the "
            "zoo builds is planned once built (corl zoo --out DIR, as the config's header says)"
        )
    return out


def released_config(model: str, models: Path) -> tuple[Path, str] | None:
    """(the configs/models/ directory, how it matched) that a not-yet-downloaded `model` names: a directory of the
    same name, or the repository id `models.json` records for one (`Qwen/Qwen2-VL-2B-Instruct`, or a local
    directory named after it: `models/Qwen2-VL-2B-Instruct`); case does not matter. None when nothing matches."""
    name = Path(model).name.lower()
    index_file = models / "models.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    for folder in sorted(p for p in models.iterdir() if (p / "config.json").is_file()):
        if folder.name.lower() == name:
            return folder, "same directory name"
        repo = str(index.get(folder.name, {}).get("repo", ""))
        if repo and (model.lower().rstrip("/") == repo.lower() or name == repo.split("/")[-1].lower()):
            return folder, f"models.json: {repo}"
    return None


def main(argv: Sequence[str]) -> int:
    parser = cli.parser("python -m vlm_corl.plan", __doc__)
    parser.add_argument("--config", required=True, help="cohort YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=2")
    parser.add_argument("--nodes", type=cli.positive_int, default=1, help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=cli.positive_int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--gpu-memory", type=memory_size, default=80 * GB, help="memory per GPU (default 80GB)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--suggest", action="store_true", help="also search the cheapest layout that fits")
    args = cli.parse(parser, argv)
    # torch loads only now (the planner builds models on the meta device): `--help` answers at once
    from vlm_corl.planning.cohort import Hardware, layout_problems, plan_cohort
    from vlm_corl.planning.fixes import fixes
    from vlm_corl.planning.micro_batch import with_micro_batch
    from vlm_corl.planning.render import render_plan
    from vlm_corl.planning.suggest import suggest

    processes = args.nodes * args.gpus_per_node
    label = f"{args.nodes} node{'s' * (args.nodes > 1)} x {args.gpus_per_node} GPU{'s' * (args.gpus_per_node > 1)}"
    hardware = Hardware(
        processes, args.gpu_memory, cuda=True, label=f"{label} of {args.gpu_memory / GB:.0f} GB",
        ranks_per_node=args.gpus_per_node,
    )  # fmt: skip
    try:
        stand_ins = released_stand_ins(args.config, args.overrides)
        cfg = load_config(args.config, [*args.overrides, *stand_ins])
    except ConfigError as err:
        raise UserError(f"{args.config}: " + "; ".join(err.problems)) from None
    cfg = with_micro_batch(cfg, hardware)  # train.micro_batch_size: auto, as a launch on `hardware` resolves it
    problems = layout_problems(cfg, processes)
    if problems and not args.suggest:
        raise UserError(
            f"{args.config} cannot launch on {processes} process(es): " + "; ".join(problems) + " (--suggest "
            "searches a placement that can)"
        )
    found = suggest(cfg, hardware) if args.suggest else None
    if problems and args.json:  # nothing to plan as the file stands: the search's answer alone, one JSON object
        print(json.dumps({"problems": problems, "suggestion": _suggestion_dict(found, cfg)}, indent=1))
        return 0
    if problems:
        print(f"{args.config} cannot launch on {processes} process(es) as it stands: " + "; ".join(problems))
        _print_suggestion(found, cfg, hardware)
        return 0
    plan = plan_cohort(cfg, hardware)
    plan.fixes = [] if plan.fits else fixes(cfg, plan)
    if args.json:
        out = plan.to_dict()
        if args.suggest:
            out["suggestion"] = _suggestion_dict(found, cfg)
        print(json.dumps(out, indent=1))
        return 0
    print(render_plan(plan, cfg.name))
    if args.suggest:
        print()
        _print_suggestion(found, cfg, hardware)
    return 0


def _suggestion_dict(found, cfg) -> dict | None:
    if found is None:
        return None
    yaml_lines = found.yaml_lines(cfg)
    return {
        "overrides": found.overrides(),
        "yaml": yaml_lines,
        "step_cost": found.step_cost,
        "plan": found.plan.to_dict(),
    }


def _print_suggestion(found, cfg, hardware) -> None:
    if found is None:
        print(f"no layout tried fits {hardware.label}: add GPUs (--gpus-per-node/--nodes) or shrink the cohort")
    else:
        print(f"cheapest layout that fits {hardware.label} (tightest rank {found.plan.worst.peak / GB:.1f} GB):")
        print("\n".join(found.yaml_lines(cfg)))
        print(f"# as overrides: {' '.join(found.overrides())}")


if __name__ == "__main__":
    sys.exit(cli.run(main))

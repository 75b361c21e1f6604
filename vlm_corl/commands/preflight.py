"""`corl preflight --config FILE.yaml [dotted.key=value ...]`: a few minutes on your own node, with your own
checkpoints and data, that say whether the run will work.

Launched the way training is (`accelerate launch -m vlm_corl.preflight --config FILE`, `torchrun ... -m
vlm_corl.preflight ...`). It prints the install against the versions the project was tested with, then each
member on its own ranks: load, engine build, one rollout of a few real prompts, one update micro-batch at the
planned size, one push and sleep/wake cycle, and the rollout guard's number after the push; per rank each phase's
peak against `corl plan`'s and the member groups' all-reduce; one checkpoint of the largest member written and
deleted. The verdict is `ready` (exit 0) or the first failure with its phase, rank, member and the fix to try
(exit 2: yours to fix; 3: measured, such as a push that does not reach the engine, or a hang); preflight.json
holds every number (--out; default OUTPUT_DIR/preflight.json; the ranks after 0 write preflight.rank1.json ... beside
it). Nothing else is left in output_dir.

Each phase has a deadline, --timeout seconds (default 300; the load phase three times that), which is also the
collectives' timeout in place of train.dist_timeout_s: a phase that hangs, or a rank whose failure leaves the others
in a collective, ends in the same verdict on every rank (the failing phase and rank; for a hang every thread's stack
in preflight.json) within that limit, not in the launcher's kill.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from vlm_corl import cli
from vlm_corl.commands.preflight_watch import PREFLIGHT_TIMEOUT_S
from vlm_corl.config import ConfigError
from vlm_corl.errors import UserError


def main(argv: Sequence[str] | None = None, prog: str = "python -m vlm_corl.preflight") -> int:
    parser = cli.parser(prog, __doc__)
    parser.add_argument("--config", required=True, help="cohort YAML file (the one you will train)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as train takes them")
    parser.add_argument("--out", default=None, help="where preflight.json goes (default: OUTPUT_DIR/preflight.json)")
    parser.add_argument(
        "--max-new-tokens",
        type=cli.positive_int,
        default=None,
        help="cap rollout.max_new_tokens for the preflight's rollouts (time; default: the configured length)",
    )
    parser.add_argument(
        "--timeout",
        type=cli.positive_float,
        default=PREFLIGHT_TIMEOUT_S,
        help=f"seconds each phase may take, and the collectives' timeout (default {PREFLIGHT_TIMEOUT_S:g}; the "
        "load phase three times it); past it the verdict names the phase and the rank that hung",
    )
    args = cli.parse(parser, argv)
    from vlm_corl.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"{args.config}: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from vlm_corl.commands.preflight_checks import PreflightOptions, run_preflight

    out = Path(args.out) if args.out else Path(cfg.output_dir) / "preflight.json"
    check_paths(out, Path(cfg.output_dir))
    options = PreflightOptions(max_new_tokens=args.max_new_tokens, timeout_s=args.timeout, out=out)
    report = run_preflight(cfg, options)
    if int(os.environ.get("RANK", 0)) != 0:
        return exit_status(report)
    print(render(report))
    if report.get("unwritten"):
        print(f"preflight.json: could not be written ({report['unwritten']}); the verdict above stands")
    else:
        print(f"preflight.json: {out}")
    return exit_status(report)


def check_paths(out: Path, output_dir: Path) -> None:
    """Before any model loads (minutes of a GPU node): --out must name a file in a folder this process can write,
    and output_dir (where the checks load, write and delete a checkpoint) a folder it can write; else a UserError
    naming the path and what to do (exit 2)."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give the file's path, e.g. --out {out / 'preflight.json'}")
    cli.output_dir(out.parent, "--out's folder")
    cli.output_dir(output_dir, "output_dir")


def exit_status(report: dict) -> int:
    """0 ready; the failure's status (2 yours to fix, 3 measured) otherwise."""
    return 0 if report["verdict"] == "ready" else report["failure"]["exit_status"]


def render(report: dict) -> str:
    """The report as lines: the install, each member's numbers, each rank's phases, the verdict last."""
    lines = ["install:"] + [f"  {v['line']}" for v in report["versions"]] + [f"  {report['cuda']}"]
    for mid, m in (report.get("members") or {}).items():
        roll = m.get("rollout", {})
        upd = m.get("update", {})
        lines.append(
            f"member {mid} ({m.get('engine')}): rollout {roll.get('responses')} responses, {roll.get('tokens')} "
            f"tokens, {roll.get('tokens_per_s')} tokens/s; update {upd.get('trained_seqs')} sequences "
            f"({upd.get('compute_dtype')}); after the push its engine is {_num(m.get('push_gap_nats'))} nats/token "
            f"from its policy (limit {m.get('push_limit_nats')})"
        )
    for r in report.get("ranks", []):
        phases = ", ".join(
            f"{name} {p['seconds']:.1f}s"
            + (f" {p['peak_gb']:.2f}GB" if p.get("peak_gb") is not None else "")
            + (f"/{p['plan_gb']:.2f} planned" if p.get("plan_gb") is not None else "")
            for name, p in r["phases"].items()
        )
        nets = ", ".join(f"{k} {v['seconds']:.3f}s" for k, v in r["collectives"].items())
        lines.append(f"rank {r['rank']} ({', '.join(r['members']) or '-'}): {phases}" + (f"; {nets}" if nets else ""))
    ck = report.get("checkpoint")
    if ck:
        lines.append(
            f"checkpoint of {ck['member']}: {ck['bytes'] / 1e9:.3f} GB in {ck['seconds']:.1f}s (planned "
            f"{ck['plan_bytes'] / 1e9:.3f} GB)"
        )
    if report.get("missing_ranks"):
        lines.append(f"ranks {report['missing_ranks']} sent no report (they hang or died)")
    lines += [f"warning: {w}" for w in report["warnings"]]
    f = report.get("failure")
    if f is None:
        lines.append(f"verdict: ready ({report['seconds']:.0f} s)")
    else:
        who = f" member {f['member']}" if f["member"] else ""
        lines.append(f"verdict: failed at {f['phase']} on rank {f['rank']}{who}: {f['error']}\n  try: {f['fix']}")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


if __name__ == "__main__":
    from vlm_corl.commands.train import exit_process

    exit_process(cli.run(main))

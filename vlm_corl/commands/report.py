"""Run report: `python -m vlm_corl.report RUN [RUN2 ...] [--out DIR] [--smooth N]` renders report.html, report.md, PNGs.

report.html (vlm_corl.reporting.html) is one self-contained page overlaying every RUN given; report.md, its PNGs and
samples.md (vlm_corl.reporting.markdown) describe the first RUN. Both read the run through vlm_corl.reporting.run_plots.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vlm_corl import cli


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("python -m vlm_corl.report", __doc__.splitlines()[0], description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dirs", type=Path, nargs="+", metavar="RUN", help="training run directories (each holds metrics.jsonl)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where report.md, report.html and the PNGs go (default: the first RUN)"
    )
    parser.add_argument(
        "--smooth", type=cli.positive_int, default=5, help="moving-average window in logged steps (1 = none)"
    )
    args = cli.parse(parser, argv)
    # matplotlib and torch load only now: `--help` and argument mistakes answer at once
    from vlm_corl.reporting.html import render_html
    from vlm_corl.reporting.markdown import render_report
    from vlm_corl.reporting.run_plots import load_run

    runs = [load_run(d) for d in _distinct(args.run_dirs)]  # every directory checked before anything is written
    report = render_report(args.run_dirs[0], args.out, args.smooth)
    print(report)
    print(render_html(runs, report.parent / "report.html", args.smooth))
    return 0


def _distinct(run_dirs: list[Path]) -> list[Path]:
    """The run directories, each once: one given again (the same directory by another path too) would draw every
    line and table row twice; a warning names it."""
    seen: dict[Path, Path] = {}
    for run_dir in run_dirs:
        first = seen.setdefault(run_dir.resolve(), run_dir)
        if first is not run_dir:
            print(f"[report] {run_dir} given twice (the same directory as {first}): reported once", file=sys.stderr)
    return list(seen.values())


if __name__ == "__main__":
    sys.exit(cli.run(main))

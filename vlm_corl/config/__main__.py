"""CLI: `python -m vlm_corl.config FILE.yaml [dotted.key=value ...]` prints the resolved config (exit 0) or the
problems (stderr, exit 2); `--explain` lists every field with its type, default and doc; `--schema [FILE]` writes
the cohort file's JSON Schema (vlm_corl.config.json_schema) for YAML editors."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from vlm_corl import cli
from vlm_corl.cli import positive_int
from vlm_corl.config.loading import ConfigError, config_warnings, dump_config, load_config
from vlm_corl.config.parse import explain


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the resolved config (exit 0) or the problems (stderr, exit 2)."""
    parser = argparse.ArgumentParser(
        prog=cli.invoked_as or "python -m vlm_corl.config",
        description="Validate a cohort config and print it resolved (every field, defaults included).",
    )
    parser.add_argument("file", nargs="?", help="cohort YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8 members.0.view=paraphrase:1")
    parser.add_argument("--explain", action="store_true", help="list every field with its type, default and doc")
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=None,
        metavar="N",
        help="also check the placement and vLLM engine layout for a launch of N processes (default: only when "
        "every member states its ranks)",
    )
    parser.add_argument(
        "--schema",
        nargs="?",
        const="-",
        default=None,
        metavar="OUT",
        help="write the cohort file's JSON Schema (draft 2020-12) to OUT (default: stdout), for YAML editors: a "
        "cohort file's first line `# yaml-language-server: $schema=OUT` gives completion and each field's doc",
    )
    args = parser.parse_args(argv)
    if args.schema is not None:
        return write_schema(args.schema)
    if args.explain:
        print(explain())
        return 0
    if args.file is None:
        parser.error("a config FILE is required (or --explain)")
    try:
        cfg = load_config(args.file, args.overrides, processes=args.processes)
    except ConfigError as err:
        n = len(err.problems)
        print(f"{args.file}: invalid cohort config ({n} problem{'s' * (n != 1)}):", file=sys.stderr)
        print("\n".join(f"  - {p}" for p in err.problems), file=sys.stderr)
        return 2
    for warning in config_warnings(cfg):  # what train warns at start, said here too
        print(f"warning: {warning}", file=sys.stderr)
    print(dump_config(cfg), end="")
    return 0


def write_schema(out: str) -> int:
    """The JSON Schema to `out` ("-": stdout); a file that cannot be written: one line naming it, exit 2."""
    from vlm_corl.config.json_schema import cohort_schema

    text = json.dumps(cohort_schema(), indent=2) + "\n"
    if out == "-":
        print(text, end="")
        return 0
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as err:
        print(f"error: --schema {out} cannot be written ({err.strerror or err}); give another file", file=sys.stderr)
        return 2
    print(f"wrote {out}: put `# yaml-language-server: $schema={out}` atop a cohort file", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

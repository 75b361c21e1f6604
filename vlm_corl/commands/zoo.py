"""Offline model zoo: randomly initialised members of every family, saved in Hugging Face format.

    python -m vlm_corl.zoo --out DIR [--families qwen2_vl,qwen3] [--size tiny|small] [--seed 0]
    python -m vlm_corl.zoo --out DIR --real qwen2-vl-2b-instruct [--device cuda] [--dtype bfloat16]

Each member goes to DIR/<family> (size tiny) or DIR/<family>-small (size small) with safetensors weights,
config, generation config (stop/pad ids, suppressed control tokens), tokenizer, processor and chat template,
and reloads with the transformers Auto classes. Everything is built from configs and a tokenizer trained
here on a corpus shipped with the package: no network. The same seed gives byte-identical weights.

`--real NAME` builds a member with a released model's architecture (configs/models/NAME, or any directory with a
config.json and preprocessor_config.json) and random weights, to DIR/NAME: the published dimensions and
vocabulary (so memory and speed are those of the real model), the released image processor, and the zoo's
offline tokenizer, the config's multimodal token ids pointed at its ids. Its answers are noise; its costs are
real. Build it where it will run (`--device cuda`: a 2B member in bf16 is initialised in seconds there).
"""

from __future__ import annotations

import argparse
import sys

from vlm_corl import cli
from vlm_corl.models.zoo import build_members, build_real, member_dir
from vlm_corl.registry import FAMILIES


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a table of family, path and parameter count."""
    parser = zoo_parser()
    args = cli.parse(parser, argv)  # also quiets the "Writing model shards" bar per member, which drowns the table
    from vlm_corl.members.families import SIZES
    from vlm_corl.members.precision import DTYPES

    if args.size not in SIZES:
        parser.error(f"argument --size: invalid choice: {args.size!r} (choose from {', '.join(SIZES)})")
    if args.arch:
        from vlm_corl.models.arch import build_arch

        n_params = build_arch(args.arch, cli.output_dir(args.out, "--out"), args.seed, args.size)
        print(f"{args.out}  {args.arch}  {n_params:,} parameters")
        return 0
    if args.real:
        path, n_params = build_real(args.real, cli.output_dir(args.out, "--out"), args.device, DTYPES[args.dtype])
        print(f"{path}  {n_params:,} parameters")
        return 0
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    _build_families(families or FAMILIES.names(), args)
    return 0


def zoo_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = cli.parser("python -m vlm_corl.zoo", __doc__)
    parser.add_argument("--out", required=True, help="output directory (members go to OUT/<family>[-small])")
    parser.add_argument("--families", help="comma-separated family names (default: all registered families)")
    parser.add_argument(
        "--size",
        default="tiny",
        help="tiny: ~0.2M parameters, for unit tests; small: ~1M, head_dim 32,"
        " servable by vLLM (members go to OUT/<family>-small)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument(
        "--real",
        metavar="NAME",
        help="a released architecture with random weights instead (configs/models/NAME or a directory)",
    )
    parser.add_argument(
        "--device", type=cli.device, default="cpu", help="--real: where the weights are initialised (e.g. cuda)"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="--real: weights dtype")
    parser.add_argument(
        "--arch",
        metavar="MODEL_TYPE",
        help="a tiny random member of any transformers chat architecture (a config.json model_type, e.g."
        " llava_onevision), served by the generic family; it goes to OUT itself",
    )
    return parser


def _build_families(names: list[str], args: argparse.Namespace) -> None:
    """The tiny members of the named families under --out, with a progress bar, then their table."""
    from tqdm import tqdm

    for name in names:
        FAMILIES.get(name)  # an unknown name fails before anything is built
    out = cli.output_dir(args.out, "--out")
    from vlm_corl.models.arch import earlier_files

    for name in names:  # a folder holding files the zoo did not write fails before anything is built
        earlier_files(member_dir(out, name, args.size))
    rows = []
    with tqdm(total=len(names), desc="zoo", unit="member", disable=None) as bar:
        for name, path, n_params in build_members(out, names, args.size, args.seed):
            rows.append((name, str(path), f"{n_params:,}"))
            bar.set_postfix_str(name, refresh=False)
            bar.update()
    header = ("family", "path", "parameters")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}")


if __name__ == "__main__":
    sys.exit(cli.run(main))

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

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_corl import cli
from vlm_corl.errors import UserError
from vlm_corl.registry import FAMILIES

if TYPE_CHECKING:
    import torch

    from vlm_corl.members.families import Family

# torch and transformers load in the functions that build (and so after `main` has parsed its arguments):
# `--help` and argument mistakes answer at once. Importing vlm_corl.members.families registers the families.

REAL_MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


def member_dir(out: str | Path, family: str, size: str = "tiny") -> Path:
    """Where build_zoo puts `family` at `size`: OUT/<family> for tiny, OUT/<family>-<size> otherwise."""
    return Path(out) / (family if size == "tiny" else f"{family}-{size}")


def build_member(family: Family, path: str | Path, size: str = "tiny", seed: int = 0) -> int:
    """Build one randomly initialised member of `family` at `size`, save it to `path`; returns its parameter count."""
    import torch

    from vlm_corl.zoo_arch import earlier_files, save_replacing

    earlier_files(path)  # a folder holding files the zoo did not write is refused before anything is built
    tokenizer = family.build_tokenizer()
    config = family.build_config(size, tokenizer)
    # Seed just before construction so a member's weights depend only on (family, size, seed).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family.model_class.from_config(config, dtype=torch.float32)
    model.generation_config = family.generation_config(tokenizer)
    processor = family.build_processor(tokenizer, size) if family.build_processor else tokenizer
    save_replacing(path, model, processor)
    released_layout(family, path)
    return sum(p.numel() for p in model.parameters())


def build_real(
    name: str | Path, out: str | Path, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0
) -> tuple[Path, int]:
    """A real-size random member (see the module docstring) at OUT/<name>, in `dtype` (default bfloat16); returns
    (its path, parameter count)."""
    import torch
    from transformers import AutoConfig

    from vlm_corl.members.families import detect_family
    from vlm_corl.zoo_arch import earlier_files, save_replacing

    dtype = torch.bfloat16 if dtype is None else dtype

    source = Path(name) if Path(name).is_dir() else REAL_MODELS / str(name)
    if not (source / "config.json").is_file():
        known = ", ".join(sorted(p.name for p in REAL_MODELS.iterdir() if (p / "config.json").is_file()))
        raise UserError(f"--real {name}: no such architecture; use a directory with a config.json or one of {known}")
    family = detect_family(source)
    path = Path(out) / Path(name).name
    earlier_files(path)  # before the (possibly long) initialisation
    tokenizer = family.build_tokenizer()
    config = AutoConfig.from_pretrained(source)
    for key, token in family.config_token_ids:
        setattr(config, key, tokenizer.convert_tokens_to_ids(token))
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = family.model_class.from_config(config, dtype=dtype)
    model.generation_config = family.generation_config(tokenizer)
    processor = tokenizer
    if family.modality == "vision":
        processor = real_processor(source, tokenizer, config)
    save_replacing(path, model, processor)
    released_layout(family, path)
    return path, sum(p.numel() for p in model.parameters())


def released_layout(family: Family, path: str | Path) -> None:
    """Rename the weights saved at `path` to the family's released checkpoints' names (`Family.released_names`),
    which vLLM reads and transformers reloads; a no-op for most families."""
    if not family.released_names:
        return
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(shard)
        save_file({family.released_name(k): v for k, v in tensors.items()}, shard, metadata=metadata)
    index = Path(path) / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {family.released_name(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def real_processor(source: Path, tokenizer, config):
    """The released processor (source/preprocessor_config.json: its class and image processor) around the
    offline tokenizer."""
    import transformers as tf

    image_processor = tf.AutoImageProcessor.from_pretrained(source)
    name = json.loads((source / "preprocessor_config.json").read_text())["processor_class"]
    cls = getattr(tf, name)
    extra = {}
    video = {"Qwen2VLProcessor": "Qwen2VLVideoProcessor", "Qwen2_5_VLProcessor": "Qwen2VLVideoProcessor"}
    video["InternVLProcessor"] = "InternVLVideoProcessor"
    if name in video:
        extra["video_processor"] = getattr(tf, video[name])()
    for key in ("image_seq_length", "mm_tokens_per_image"):  # InternVL, Gemma-3: image tokens per tile
        if getattr(config, key, None):
            extra["image_seq_length"] = getattr(config, key)
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template, **extra)


def build_zoo(out: str | Path, families: list[str] | None = None, size: str = "tiny", seed: int = 0) -> dict[str, Path]:
    """Build the named families (default: every registered one) under `out`; returns {family: member path}."""
    return {name: path for name, path, _ in _build(out, families, size, seed)}


def _build(out, families, size, seed):
    """Yield (name, path, parameter count) as each member is built, so the CLI can report progress."""
    from vlm_corl.members.families import SIZES

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; use one of {', '.join(SIZES)}")
    names = families or FAMILIES.names()
    chosen = [FAMILIES.get(name) for name in names]  # resolve all names before building anything
    for family in chosen:
        path = member_dir(out, family.name, size)
        yield family.name, path, build_member(family, path, size, seed)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints a table of family, path and parameter count."""
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
    args = cli.parse(parser, argv)  # also quiets the "Writing model shards" bar per member, which drowns the table
    from tqdm import tqdm

    from vlm_corl.members.families import SIZES
    from vlm_corl.members.precision import DTYPES

    if args.size not in SIZES:
        parser.error(f"argument --size: invalid choice: {args.size!r} (choose from {', '.join(SIZES)})")
    if args.arch:
        from vlm_corl.zoo_arch import build_arch

        n_params = build_arch(args.arch, cli.output_dir(args.out, "--out"), args.seed, args.size)
        print(f"{args.out}  {args.arch}  {n_params:,} parameters")
        return 0
    if args.real:
        path, n_params = build_real(args.real, cli.output_dir(args.out, "--out"), args.device, DTYPES[args.dtype])
        print(f"{path}  {n_params:,} parameters")
        return 0
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    names = families or FAMILIES.names()
    for name in names:
        FAMILIES.get(name)  # an unknown name fails before anything is built
    out = cli.output_dir(args.out, "--out")
    from vlm_corl.zoo_arch import earlier_files

    for name in names:  # a folder holding files the zoo did not write fails before anything is built
        earlier_files(member_dir(out, name, args.size))
    rows = []
    with tqdm(total=len(names), desc="zoo", unit="member", disable=None) as bar:
        for name, path, n_params in _build(out, names, args.size, args.seed):
            rows.append((name, str(path), f"{n_params:,}"))
            bar.set_postfix_str(name, refresh=False)
            bar.update()
    header = ("family", "path", "parameters")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))

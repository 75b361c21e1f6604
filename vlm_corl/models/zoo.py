"""The offline model zoo's builders: randomly initialised members of every family (`build_zoo`,
`build_member`), or of a released architecture (`build_real`), saved in Hugging Face format from configs and the
zoo's offline tokenizer; the same seed gives byte-identical weights. What each builds and where it goes: the
command's page, `corl zoo --help` (vlm_corl.commands.zoo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_corl.errors import UserError
from vlm_corl.registry import FAMILIES

if TYPE_CHECKING:
    import torch

    from vlm_corl.members.families import Family

# torch and transformers load in the functions that build (and so after `main` has parsed its arguments):
# `--help` and argument mistakes answer at once. Importing vlm_corl.members.families registers the families.

REAL_MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def member_dir(out: str | Path, family: str, size: str = "tiny") -> Path:
    """Where build_zoo puts `family` at `size`: OUT/<family> for tiny, OUT/<family>-<size> otherwise."""
    return Path(out) / (family if size == "tiny" else f"{family}-{size}")


def build_member(family: Family, path: str | Path, size: str = "tiny", seed: int = 0) -> int:
    """Build one randomly initialised member of `family` at `size`, save it to `path`; returns its parameter count."""
    import torch

    from vlm_corl.models.arch import earlier_files, save_replacing

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
    from vlm_corl.models.arch import earlier_files, save_replacing

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
    return {name: path for name, path, _ in build_members(out, families, size, seed)}


def build_members(out, families, size, seed):
    """Yield (name, path, parameter count) as each member is built, so the CLI can report progress."""
    from vlm_corl.members.families import SIZES

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; use one of {', '.join(SIZES)}")
    names = families or FAMILIES.names()
    chosen = [FAMILIES.get(name) for name in names]  # resolve all names before building anything
    for family in chosen:
        path = member_dir(out, family.name, size)
        yield family.name, path, build_member(family, path, size, seed)

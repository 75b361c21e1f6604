"""What the memory planner needs to know of a model, read from its config.json alone: parameter counts on the
`meta` device (no weights read or allocated, so it works on the released architectures under configs/models/
and on a downloaded checkpoint's directory alike), the language model's dimensions (hidden size, layers, KV
heads, head dim, vocabulary) and the vision tower's (width, depth, patches per image at the trainer's cap).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from vlm_corl.errors import UserError
from vlm_corl.members.lora import VISION_TOWERS, adapter_parameters

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vlm_corl.config.schema import MemberConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Vision towers that do not take an image at its own resolution: tiles (or one fixed square) of image_size.
# InternVL: up to max_patches tiles plus a thumbnail (GotOcr2ImageProcessor); Llama-3.2-Vision: max_num_tiles
# tiles of 560 px, each with a class token; Gemma-3: one 896 px square (pan-and-scan off).
TILED = {"internvl", "mllama", "gemma3"}


@dataclass(frozen=True)
class ModelShape:
    """A model's sizes as the planner uses them (see the module docstring)."""

    params: int  # every parameter, tied weights once
    largest_tensor: int  # elements of the largest parameter (what ZeRO-3 gathers at once, at least)
    checkpoint_bytes: int  # bytes per parameter of the checkpoint's dtype (config.json dtype; 4 if unknown)
    hidden: int  # the language model's
    layers: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    vision_params: int = 0
    vision_hidden: int = 0
    vision_layers: int = 0
    vision_intermediate: int = 0
    patch_size: int = 0
    fixed_patches: int = 0  # patches per image of a tiled/fixed-size tower (0: the image's pixels decide)
    processor_dir: str = ""  # a generic member's directory: its own image processor decides (`processor_patches`)
    heads: int = 0  # the language model's query heads (0: hidden // head_dim)
    # Whether its self-attention fits the HF engine's static decoder (`static_decode.unsupported`: full attention
    # in every layer, no cross-attention, plain static cache layers); True where unknown (its bucket is the
    # larger count)
    static_decode: bool = True
    pow2_params: int = 0  # the sum over its parameter tensors of their elements rounded up to a power of two

    @property
    def is_vision(self) -> bool:
        return self.vision_layers > 0

    def patches_per_image(self, max_image_pixels: int) -> int:
        """Vision-tower positions of one image at the trainer's pixel cap (data.max_image_pixels)."""
        if not self.is_vision:
            return 0
        if self.processor_dir:
            measured = processor_patches(self.processor_dir, self.patch_size, max_image_pixels)
            if measured:
                return measured
        return self.fixed_patches or math.ceil(max_image_pixels / self.patch_size**2)


def _first(obj, *names, default=None):
    for name in names:
        value = getattr(obj, name, None)
        if value:
            return value
    return default


def _side(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


# The language model's sizes under the standard names (which a config's attribute_map translates: GPT-2's
# hidden_size is its n_embd), then under the names configs without a map entry use. GPT-2 has no
# intermediate_size; its n_inner None means 4 x n_embd, the width `TEXT_SIZES` falls back to.
TEXT_SIZES = {
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff", "mlp_dim"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "vocab": ("vocab_size",),
}


def text_sizes(text, model_dir: str) -> dict[str, int]:
    """The `ModelShape` fields of a language model's config (any object with attributes): hidden, layers,
    intermediate, kv_heads, head_dim, vocab. A size it names under none of `TEXT_SIZES` is a UserError."""
    found = {key: _first(text, *names) for key, names in TEXT_SIZES.items()}
    found["intermediate"] = found["intermediate"] or (found["hidden"] and 4 * found["hidden"])
    found["kv_heads"] = found["kv_heads"] or found["heads"]
    missing = [key for key, value in found.items() if not isinstance(value, int)]
    if missing:
        names = "; ".join(f"{key}: {' or '.join(TEXT_SIZES[key])}" for key in missing)
        raise UserError(f"{model_dir}: cannot plan this model: its config.json names none of ({names})")
    return {**found, "head_dim": _first(text, "head_dim") or found["hidden"] // found["heads"]}


@lru_cache(maxsize=8)
def _meta_model(model_dir: str):
    """(config, the model on the `meta` device) of the config.json in `model_dir`: shapes without weights."""
    import torch
    from transformers import AutoConfig

    import vlm_corl.members.families  # noqa: F401  (registers the vision families)
    from vlm_corl.members.families import detect_family

    if _own_code(model_dir):
        raise UserError(
            f"{model_dir}: the checkpoint ships its own modelling code, which the planner does not run, so its "
            "modules (LoRA targets) cannot be counted; plan it without lora, or set train.check_memory: off"
        )
    try:  # the family first: its message names what an unknown architecture lacks
        family = detect_family(model_dir)
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"{model_dir}: cannot plan this model from its config.json: {err}") from None
    with torch.device("meta"):
        return config, family.model_class.from_config(config)


@lru_cache(maxsize=64)
def adapter_count(model_dir: str, r: int, targets: tuple[str, ...] | None, vision: bool) -> int:
    """Parameters LoRA adapters of rank `r` add to the model in `model_dir` (`vlm_corl.members.lora`)."""
    from vlm_corl.config.schema import LoraConfig

    lora = LoraConfig(r=r, target_modules=list(targets) if targets else None, vision=vision)
    return adapter_parameters(_meta_model(model_dir)[1], lora)


@lru_cache(maxsize=64)
def model_shape(model_dir: str) -> ModelShape:
    """The `ModelShape` of the model whose config.json is in `model_dir` (cached per directory)."""

    import vlm_corl.members.families  # noqa: F401  (registers the vision families)

    if _own_code(model_dir):
        return _shape_from_weights(model_dir)
    config, model = _meta_model(model_dir)
    params = list(model.parameters())  # tied weights appear once
    vision_module = next((m for name, m in model.named_modules() if name.endswith(VISION_TOWERS)), None)
    text = config.get_text_config()
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or text.to_dict().get("dtype") or "float32")
    fields = dict(
        params=sum(p.numel() for p in params),
        largest_tensor=max(p.numel() for p in params),
        pow2_params=sum(pow2_ceil(p.numel()) for p in params),
        static_decode=static_decodable(config),
        checkpoint_bytes=DTYPE_BYTES.get(dtype.removeprefix("torch."), 4),
        **text_sizes(text, model_dir),
    )
    vision = getattr(config, "vision_config", None)
    if vision is not None and vision_module is not None:
        width = _first(vision, "embed_dim", "hidden_size")
        patch = _side(vision.patch_size)
        fields.update(
            vision_params=sum(p.numel() for p in vision_module.parameters()),
            vision_hidden=width,
            vision_layers=_first(vision, "depth", "num_hidden_layers"),
            vision_intermediate=_first(
                vision, "intermediate_size", default=int(width * getattr(vision, "mlp_ratio", 4))
            ),
            patch_size=patch,
            fixed_patches=_tiled_patches(config.model_type, vision, patch, Path(model_dir)),
            processor_dir=model_dir if _generic_with_processor(model_dir, config.model_type) else "",
        )
    return ModelShape(**fields)


def pow2_ceil(n: int) -> int:
    """`n` rounded up to a power of two (torch's CachingHostAllocator rounds each pinned block so)."""
    return 1 << max(n - 1, 0).bit_length()


def static_decodable(config) -> bool:
    """Whether the HF engine's static decoder can hold a model of `config`'s decoding state: the checks of
    `static_decode.unsupported` that the config alone decides (full attention without a sliding window in every
    layer, no cross-attention layers, plain static cache layers); its attention implementation is the member's
    (sdpa: `cohort`)."""
    from vlm_corl.members.static_decode import static_layer_kinds

    text = config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    if layer_types != {"full_attention"} or sliding or getattr(text, "cross_attention_layers", None):
        return False
    return static_layer_kinds(config) == {"StaticLayer"}


Shapes = dict[str, ModelShape]  # member id -> its model's shape, one plan's (`cohort_shapes`)


def cohort_shapes(members: Iterable[MemberConfig]) -> Shapes:
    """{member id: ModelShape}, each distinct model directory read once: a plan builds it at its start and passes
    it down, so no sub-planner reads a model again (members sharing a model share its shape)."""
    by_dir: dict[str, ModelShape] = {}
    out: Shapes = {}
    for m in members:
        model = str(m.model)
        if model not in by_dir:
            by_dir[model] = model_shape(model)
        out[m.id] = by_dir[model]
    return out


def _own_code(model_dir: str) -> bool:
    """Whether the checkpoint in `model_dir` ships its own modelling code (`generic.ships_own_code`)."""
    from vlm_corl.members.families.generic import ships_own_code

    try:
        return ships_own_code(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError):
        return False  # unreadable: `_meta_model` says what is wrong


def _shape_from_weights(model_dir: str) -> ModelShape:
    """The shape of a checkpoint that ships its own modelling code, without running that code (the member's
    trust_remote_code lets the member load it, not the planner): parameters from its safetensors files' headers,
    the language model's sizes from config.json. Its vision tower, if any, is left out of the activations."""
    from safetensors import safe_open

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = []
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            shapes += [math.prod(f.get_slice(name).get_shape()) for name in f.keys()]
    if not shapes:
        raise UserError(
            f"{model_dir}: the checkpoint ships its own modelling code, which the planner does not run, and holds no "
            "*.safetensors weights to count instead; download its weights, or set train.check_memory: off"
        )
    if "vision_config" in raw:
        logging.getLogger("vlm_corl").warning(
            "planning %s: its own modelling code is not run, so its vision tower's activations are not planned",
            model_dir,
        )
    text = SimpleNamespace(**(raw.get("text_config") or raw))
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    return ModelShape(
        params=sum(shapes),
        largest_tensor=max(shapes),
        pow2_params=sum(pow2_ceil(n) for n in shapes),
        checkpoint_bytes=DTYPE_BYTES.get(dtype.removeprefix("torch."), 4),
        **text_sizes(text, model_dir),
    )


def _generic_with_processor(model_dir: str, model_type: str) -> bool:
    """A downloaded generic member: no family knows how its tower tiles the image, but its processor does."""
    from vlm_corl.members.families import family_for_model_type

    try:
        family_for_model_type(model_type)
        return False
    except ValueError:
        has = (Path(model_dir) / name for name in ("preprocessor_config.json", "processor_config.json"))
        return any(path.is_file() for path in has)


# Image shapes of `max_image_pixels` the planner asks a processor about: square, wide, tall and the aspects between
# (tiling processors pick their grid by aspect ratio: GotOcr2's, Aya Vision's, makes 12 tiles of a 4:3 image and
# 5 of a 4:1 one).
ASPECTS = (1.0, 4.0, 0.25, 4 / 3, 3 / 4, 2.0, 0.5, 3.0, 1 / 3)


@lru_cache(maxsize=64)
def processor_patches(model_dir: str, patch: int, max_image_pixels: int) -> int:
    """Vision-tower positions of the largest image a generic member's own image processor makes from an image of
    `max_image_pixels` (the cap every image is shrunk to at loading; the generic family resizes no further):
    the most over square, wide and tall images. Tiling processors (LLaVA-OneVision's any-resolution grid,
    Idefics3's splitting) make several tiles of one image, which the pixel count alone would miss. 0 (and a
    warning in the log) when the processor cannot count them: the caller falls back to the pixel count."""
    from PIL import Image
    from transformers import AutoProcessor

    # The whole processor, as rendering uses it: some pass their image processor settings of their own (Pixtral's
    # patch size times its merge size).
    most = 0
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        for aspect in ASPECTS:
            width = max(1, round(math.sqrt(max_image_pixels * aspect)))
            height = max(1, max_image_pixels // width)
            image = Image.new("RGB", (width, height))
            out = processor(text=[processor.image_token], images=[image], return_tensors="pt")
            most = max(most, tower_positions(out, patch))
    except Exception as err:  # noqa: BLE001 - an estimate: any processor failure falls back, said in the log
        logging.getLogger("vlm_corl").warning(
            "planning %s: its processor did not count an image's vision-tower positions (%s: %s); planned from "
            "the pixel cap over the patch area, which misses tiles",
            model_dir,
            type(err).__name__,
            str(err)[:200],
        )
        return 0
    return most


def tower_positions(processed, patch: int) -> int:
    """Vision-tower positions of one processed image: the patch grid's cells (Qwen-style `image_grid_thw`),
    the rows of flattened patches, or tiles x (tile side / patch)^2 for (…, channels, height, width) pixels."""
    if "image_grid_thw" in processed:
        return int(processed["image_grid_thw"].prod(dim=-1).sum())
    pixels = processed["pixel_values"]
    if pixels.dim() == 2:
        return pixels.shape[0]
    tiles = math.prod(pixels.shape[:-3])
    return tiles * (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)


def _tiled_patches(model_type: str, vision, patch: int, model_dir: Path) -> int:
    """Patches per image of a tiled or fixed-size vision tower (`TILED`); 0 for towers that follow the image."""
    if model_type not in TILED:
        return 0
    per_tile = (_side(vision.image_size) // patch) ** 2
    if model_type == "gemma3":
        return per_tile
    if model_type == "mllama":
        return vision.max_num_tiles * (per_tile + 1)
    processor = model_dir / "preprocessor_config.json"
    tiles = json.loads(processor.read_text()).get("max_patches", 12) if processor.exists() else 12
    return (tiles + 1) * per_tile  # InternVL: the tiles and a thumbnail


def parameter_count(model_dir: str | Path) -> int:
    """Parameters of the model a config.json describes, counted on the `meta` device (no weights are read or
    allocated: it works on configs/models/ and on a downloaded checkpoint's directory alike); tied weights once."""
    return model_shape(str(model_dir)).params

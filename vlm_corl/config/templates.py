"""The variables a model directory's chat template reads, from its files alone (no tokenizer is loaded): what
`members[i].chat_template_kwargs` is checked against before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where transformers keeps a chat template: its own file (tokenizer and processor, transformers >= 4.43), a
# processor's JSON, or a key of the tokenizer's or processor's config (a string, or a list of named templates).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json", "processor_config.json")


def chat_template_texts(model_dir: Path) -> list[str]:
    """Every chat template stored in `model_dir` (none where it has none, or its files cannot be read)."""
    texts = []
    for name in TEMPLATE_FILES:
        path = Path(model_dir) / name
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if name.endswith(".jinja"):
            texts.append(raw)
            continue
        try:
            found = json.loads(raw).get("chat_template")
        except (ValueError, AttributeError):
            continue
        if isinstance(found, str):
            texts.append(found)
        elif isinstance(found, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            texts += [t["template"] for t in found if isinstance(t, dict) and isinstance(t.get("template"), str)]
    return texts


def chat_template_variables(model_dir: Path) -> set[str] | None:
    """The names the chat templates of `model_dir` read from outside (messages, add_generation_prompt,
    enable_thinking, ...); None where there is no template, or one that does not parse here (an extension tag
    of transformers' own, such as `{% generation %}`): then nothing can be said."""
    texts = chat_template_texts(model_dir)
    if not texts:
        return None
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])  # as transformers compiles them
    names: set[str] = set()
    for text in texts:
        try:
            names |= meta.find_undeclared_variables(env.parse(text))
        except jinja2.TemplateSyntaxError:
            return None
    return names

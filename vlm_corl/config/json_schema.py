"""The cohort file as a JSON Schema (draft 2020-12), made from the dataclasses of `vlm_corl.config.schema`:
`corl config --schema [FILE]` writes it for YAML editors (the YAML language server of VS Code's Red Hat YAML
extension and JetBrains' IDEs: completion, each field's help on hover, a typo underlined as it is typed).

Each field carries its help as `description`, its default, its bounds (ge/gt/le/lt as minimum/exclusiveMinimum/
maximum/exclusiveMaximum), its pattern (anchored: the parser matches the whole value) and min_items (minItems);
Literal choices are an `enum`; a union (`int | "auto"`, `str | list`, a null) is an `anyOf` of its arms; every
section has `additionalProperties: false`, as the parser refuses an unknown key. A section may be null (the
parser reads an empty `rollout:` as all defaults). Checks across fields (`loading.validate`) are the parser's
alone: the schema says what each field may hold, `corl config FILE` whether the whole file makes sense.
Every keyword used means the same in draft-07, the draft the YAML language server validates by.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from vlm_corl.config.parse import field_default
from vlm_corl.config.schema import CohortConfig

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# a field's constraint (schema.py's _f) -> its JSON Schema keyword; each applies to values of its own kind only,
# as the parser's bounds skip "auto" and its pattern a null
KEYWORDS = {
    "ge": "minimum",
    "gt": "exclusiveMinimum",
    "le": "maximum",
    "lt": "exclusiveMaximum",
    "min_items": "minItems",
}
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def cohort_schema() -> dict:
    """The JSON Schema of a cohort YAML file (see the module docstring)."""
    return {
        "$schema": DRAFT,
        "title": "Co-RL cohort config",
        **section_schema(CohortConfig, nullable=False),
    }


def section_schema(cls: type, nullable: bool = True) -> dict:
    """A config dataclass as an object schema: its fields' schemas, those without a default required, no other
    key; `nullable`: a null section is also valid (read as all defaults)."""
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    out = {
        "type": ["object", "null"] if nullable else "object",
        "description": " ".join((cls.__doc__ or "").split()),
        "properties": {f.name: field_schema(f, hints[f.name]) for f in fields},
        "additionalProperties": False,
    }
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        out["required"] = required
    return out


def field_schema(f: dataclasses.Field, tp: Any) -> dict:
    """One field: its type's schema with the field's help, default and constraints."""
    out = type_schema(tp)
    meta = f.metadata
    out["description"] = meta["help"] if not dataclasses.is_dataclass(tp) else f"{meta['help']}: {out['description']}"
    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
        default = field_default(f)
        if not dataclasses.is_dataclass(default):  # a section's defaults are its fields'
            out["default"] = default
    for key, keyword in KEYWORDS.items():
        if key in meta:
            out[keyword] = meta[key]
    if "pattern" in meta:
        out["pattern"] = f"^(?:{meta['pattern'][0]})$"  # JSON Schema searches; the parser matches the whole value
    return out


def type_schema(tp: Any) -> dict:
    """The schema of the values the parser (`parse.parse_value`) accepts for the annotation `tp`."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return section_schema(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [type_schema(arm) for arm in args]}
    if origin is Literal:
        return {"type": "string", "enum": list(args)}
    if origin is list:
        item = args[0]
        return {
            "type": "array",
            "items": section_schema(item, False) if dataclasses.is_dataclass(item) else type_schema(item),
        }
    if origin is dict or tp is dict:
        return {"type": "object"}
    if tp is type(None):
        return {"type": "null"}
    if tp is Any:
        return {}
    return {"type": JSON_TYPES[tp]}

"""`corl config --schema [FILE]` (vlm_corl/config/json_schema.py): the cohort file's JSON Schema, from the
dataclasses of vlm_corl/config/schema.py. Each field's help is its description, its default, bounds, pattern and
choices are there, every section refuses unknown keys; every shipped cohort file validates against it and a file
with an unknown key, a choice typo or a value out of bounds does not, as the parser refuses each (validated by the
`jsonschema` package, a dev dependency)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

import jsonschema
import pytest
import yaml

from vlm_corl.config import ConfigError, config_from_dict
from vlm_corl.config.__main__ import main
from vlm_corl.config.json_schema import KEYWORDS, cohort_schema
from vlm_corl.config.schema import CohortConfig

ROOT = Path(__file__).resolve().parents[1]
COHORT_FILES = sorted((ROOT / "configs" / "cohorts").glob("*.yaml"))


def _sections(cls: type, node: dict, path: str = ""):
    """(dotted path, dataclass field, annotation, its schema) of every field, depth first."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, sub = hints[f.name], node["properties"][f.name]
        yield f"{path}{f.name}", f, tp, sub
        arms = get_args(tp) if get_args(tp) and get_origin(tp) is not Literal else (tp,)
        for arm, arm_node in zip(arms, sub.get("anyOf", [sub] * len(arms))):
            inner = get_args(arm)[0] if get_origin(arm) is list else arm
            if dataclasses.is_dataclass(inner):
                yield from _sections(inner, arm_node.get("items", arm_node), f"{path}{f.name}.")


def _choices(tp) -> list:
    """The Literal choices anywhere in an annotation (`bool | Literal["auto"]`, `list[Literal[...]]`)."""
    return list(get_args(tp)) if get_origin(tp) is Literal else [c for arm in get_args(tp) for c in _choices(arm)]


def _enums(node: dict) -> list:
    """The enum values anywhere in a field's schema, but in a section's own fields."""
    arms = node.get("anyOf", []) + ([node["items"]] if "items" in node and "properties" not in node["items"] else [])
    return node.get("enum", []) + [v for arm in arms for v in _enums(arm)]


def test_every_field_carries_its_help_default_bounds_and_choices(tmp_path):
    schema = cohort_schema()
    fields = list(_sections(CohortConfig, schema))
    assert len(fields) > 100
    for path, f, tp, node in fields:
        assert node["description"].startswith(f.metadata["help"]), path
        for key, keyword in KEYWORDS.items():
            assert node.get(keyword) == f.metadata.get(key), path
        if f.default is not dataclasses.MISSING:
            assert node["default"] == f.default, path
        assert _enums(node) == _choices(tp), path
    sections = [n for *_, n in fields if "properties" in n] + [schema]
    assert all(n["additionalProperties"] is False for n in sections)
    assert schema["required"] == ["members"] and schema["$schema"].endswith("/draft/2020-12/schema")
    out = tmp_path / "cohort.schema.json"
    assert main(["--schema", str(out)]) == 0
    assert json.loads(out.read_text()) == schema


def _validator(draft: str = "Draft202012Validator"):
    """The schema's validator; draft-07's reads it alike (the YAML language server validates by draft-07)."""
    kind = getattr(jsonschema, draft)
    kind.check_schema(cohort_schema())
    return kind(cohort_schema())


@pytest.mark.parametrize("path", COHORT_FILES, ids=lambda p: p.name)
def test_every_shipped_cohort_file_validates(path):
    for draft in ("Draft202012Validator", "Draft7Validator"):
        found = _validator(draft).iter_errors(yaml.safe_load(path.read_text()))
        assert [f"{list(e.absolute_path)}: {e.message}" for e in found] == [], draft


BAD = {  # a change to a shipped file -> the path the schema and the parser both name
    "unknown key": (("train", "lrr", 1e-4), ["train"]),
    "choice typo": (("reward", "mode", "peer_ema"), ["reward", "mode"]),
    "below a bound": (("rollout", "n", 1), ["rollout", "n"]),
    "a member's unknown key": (("members", "lr_scale", 2.0), ["members", 0]),
    "pattern": (("members", "id", "a b"), ["members", 0, "id"]),
    "auto or a number": (("train", "micro_batch_size", "max"), ["train", "micro_batch_size"]),
}


@pytest.mark.parametrize("mistake", sorted(BAD))
def test_a_bad_cohort_file_fails_the_schema_as_the_parser_refuses_it(mistake):
    (section, key, value), where = BAD[mistake]
    raw = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "cohorts" / "tiny_easyvqa.yaml").read_text()))
    target = raw[section][0] if section == "members" else raw[section]
    target[key] = value
    for draft in ("Draft202012Validator", "Draft7Validator"):
        errors = list(_validator(draft).iter_errors(raw))
        assert [list(e.absolute_path) for e in errors] == [where], (draft, [e.message for e in errors])
    with pytest.raises(ConfigError) as refused:
        config_from_dict(raw)
    assert ".".join(map(str, where)).replace(".0", "[0]") in str(refused.value)

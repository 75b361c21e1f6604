"""Generic config walking: YAML reading, type-directed parsing with constraint checks, dotted overrides, --explain.

Everything here is driven by the dataclass fields and type hints of `vlm_corl.config.schema`: no field has
its own parsing code.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
from collections.abc import Sequence
from dataclasses import MISSING
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from vlm_corl.config.renamed import renamed_hint
from vlm_corl.config.schema import CohortConfig
from vlm_corl.errors import UserError


class ConfigError(UserError, ValueError):
    """Every problem found in a config, each a line naming the dotted field and the fix."""

    def __init__(self, problems: list[str], fields: Sequence[str] = ()):
        self.problems = list(problems)
        # The dotted field of each problem (parallel to `problems`); lets parse errors suppress the cross-field
        # complaints about the same field, which would only repeat them.
        self.fields = list(fields) or [""] * len(self.problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return f"invalid config: {self.problems[0]}"
        return f"{len(self.problems)} config problems:\n" + "\n".join(f"  - {p}" for p in self.problems)


class Problems:
    """Accumulates (field, message) pairs while walking a config."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str, *, prefixed: bool = True) -> None:
        self.items.append((path, f"{path}: {message}" if prefixed and path else message))

    def covers(self, path: str) -> bool:
        """Whether `path` is, or lies inside, a field already reported."""
        return any(path == p or path.startswith((p + ".", p + "[")) for p, _ in self.items if p)

    def error(self) -> ConfigError:
        return ConfigError([m for _, m in self.items], [p for p, _ in self.items])


class YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans and floats that rejects duplicate keys.

    PyYAML follows YAML 1.1, where `mixed_precision: no` would be the boolean false, `lr: 1e-6` (no dot) a
    string, and a repeated key (two `rollout:` sections) silently drops the first one.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


_BOOL_TAG = "tag:yaml.org,2002:bool"
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_problem(source: str, err: yaml.YAMLError) -> str:
    """One line `source:line:column: invalid YAML: what` (1-based, as editors count)."""
    mark = getattr(err, "problem_mark", None)
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
    what = getattr(err, "problem", None) or str(err)
    return f"{where}: invalid YAML: {what}"


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def describe(tp: Any) -> str:
    """How a type reads in a message: 'an integer', 'k1 or k3', 'a list of strings', ..."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " or ".join(args)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is list and get_origin(args[0]) is Literal:
        return f"a list of names from: {', '.join(get_args(args[0]))}"
    if origin is list:
        return f"a list of {describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def yaml_kind(value: Any) -> str:
    """The YAML name of a value's type, for messages."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _type_problem(problems: Problems, path: str, tp: Any, value: Any) -> None:
    got = yaml_kind(value)
    if isinstance(value, bool):
        got += f" {str(value).lower()}"
    elif isinstance(value, (int, float, str)):
        got += f" {value!r}"
    hint = ""
    if isinstance(value, str) and tp in (int, float):
        try:
            float(value)
            hint = " (write the number without quotes)"
        except ValueError:
            pass
    problems.add(path, f"expected {describe(tp)}, got {got}{hint}")


def _empty(tp: Any) -> Any:
    """A stand-in for a required value that is missing or invalid, so the walk can go on collecting problems."""
    if dataclasses.is_dataclass(tp):
        return tp(**{f.name: _empty(h) for f, h in _fields(tp) if _is_required(f)})
    return {list: [], str: ""}.get(get_origin(tp) or tp)


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def field_default(f: dataclasses.Field) -> Any:
    """A schema field's default value (a fresh one for a factory's)."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _unknown_key(path: str, key: Any, cls: type) -> str:
    """The message for a key `cls` lacks: its new spelling when it was renamed or removed
    (vlm_corl.config.renamed), else the closest valid key or where a same-named field lives."""
    renamed = renamed_hint(path)
    if renamed is not None:
        return renamed
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    if close:
        return f"unknown key {path!r}: did you mean {close[0]!r}?"
    # A right name in the wrong section (`rollout.lr`) is a common slip: point at where it lives, section fields
    # first (a stray top-level `lr` more likely means train.lr than members[].lr).
    elsewhere = sorted((p for p, _, _ in _walk(CohortConfig) if p.rsplit(".", 1)[-1] == key), key=lambda p: "[]" in p)
    if elsewhere:
        return f"unknown key {path!r}: did you mean {' or '.join(map(repr, elsewhere))}?"
    return f"unknown key {path!r}: valid keys: {', '.join(names)}"


# Other tools' names for our settings (TRL's GRPOConfig, verl's actor config): {(field, their value): (what it
# is, our setting)}, said before difflib's nearest spelling, which points `policy_loss: dapo` at sapo, another
# objective. TRL's loss_type and verl's loss_agg_mode name our algo.loss_agg, and are often written as the
# objective.
_DAPO = (
    "TRL's loss_type dapo is DAPO's token-level loss aggregation",
    "algo.loss_agg=token_mean; DAPO's other parts are algo.clip_high=0.28, algo.resample_zero_variance=true, "
    "algo.overlong_penalty and algo.mask_truncated=true",
)
_LOSS_NAMES = {
    "dapo": _DAPO,
    "bnpo": ("TRL's loss_type bnpo normalises by the batch's tokens", "algo.loss_agg=token_mean"),
    "dr_grpo": ("TRL's loss_type dr_grpo is Dr. GRPO", "algo.loss_agg=drgrpo with algo.scale_rewards=none"),
    "token-mean": ("verl's loss_agg_mode token-mean", "algo.loss_agg=token_mean"),
    "seq-mean-token-mean": ("verl's loss_agg_mode seq-mean-token-mean", "algo.loss_agg=seq_mean_token_mean"),
    "seq-mean-token-sum-norm": (
        "verl's loss_agg_mode seq-mean-token-sum-norm is Dr. GRPO's constant normaliser (algo.drgrpo_norm)",
        "algo.loss_agg=drgrpo",
    ),
    "seq-mean-token-sum": ("verl's loss_agg_mode seq-mean-token-sum", "algo.loss_agg=drgrpo with algo.drgrpo_norm=1"),
}
OTHER_NAMES: dict[tuple[str, Any], tuple[str, str]] = {
    **{("algo.loss_agg", name): said for name, said in _LOSS_NAMES.items()},
    **{("algo.policy_loss", name): said for name, said in _LOSS_NAMES.items()},
    ("algo.loss_agg", "grpo"): (
        "TRL's loss_type grpo averages each response's tokens, then the responses",
        "algo.loss_agg=seq_mean_token_mean",
    ),
    ("algo.policy_loss", "vanilla"): (
        "verl's policy_loss vanilla is PPO's clip of each token's ratio",
        "algo.policy_loss=grpo",
    ),
    ("algo.policy_loss", "ppo"): ("PPO's clip of each token's ratio", "algo.policy_loss=grpo"),
    ("algo.kl_estimator", "low_var_kl"): ("verl's kl_loss_type low_var_kl is the k3 estimator", "algo.kl_estimator=k3"),
    ("algo.kl_estimator", "kl"): ("verl's kl_loss_type kl is the k1 estimator", "algo.kl_estimator=k1"),
    ("algo.scale_rewards", True): ("TRL's scale_rewards: true divides by each group's std", "algo.scale_rewards=group"),
    ("algo.scale_rewards", False): ("TRL's scale_rewards: false only centres the rewards", "algo.scale_rewards=none"),
}


def _choice_hint(path: str, value: Any, choices: tuple) -> str:
    """What an invalid choice may have meant: the setting another tool's name stands for (`OTHER_NAMES`), else
    the closest spelling."""
    said = OTHER_NAMES.get((path, value)) if isinstance(value, (str, bool)) else None
    if said is not None:
        return f" ({said[0]}: set {said[1]})"
    close = difflib.get_close_matches(str(value), [str(a) for a in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_INVALID = object()  # what parse_value returns for a value it cannot use (the problem is already recorded)


def parse_value(tp: Any, value: Any, path: str, problems: Problems) -> Any:
    """Convert a YAML value to `tp`, recording problems; returns _INVALID for an unusable value."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, value, path, problems)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) == 1:
            return parse_value(arms[0], value, path, problems)
        for arm in arms:
            trial = Problems()
            parsed = parse_value(arm, value, path, trial)
            if not trial.items:
                return parsed
        _type_problem(problems, path, tp, value)
        return _INVALID
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        problems.add(path, f"{value!r} is not valid; choose one of: {', '.join(args)}{_choice_hint(path, value, args)}")
        return _INVALID
    if origin is list:
        if not isinstance(value, list):
            _type_problem(problems, path, tp, value)
            return _INVALID
        items = [parse_value(args[0], item, f"{path}[{i}]", problems) for i, item in enumerate(value)]
        # Keep bad items' places so that indices in later messages still match the file.
        return [_empty(args[0]) if item is _INVALID else item for item in items]
    if origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problems.add(path, f"expected a mapping with string keys, got {yaml_kind(value)}")
            return _INVALID
        return dict(value)
    if tp is Any:
        return value
    if tp is float and type(value) is int:
        return float(value)
    # Exact type: bool is an int subclass in Python, but `n: true` is a mistake, not 1.
    if type(value) is not tp:
        _type_problem(problems, path, tp, value)
        return _INVALID
    return value


def _parse_dataclass(cls: type, value: Any, path: str, problems: Problems) -> Any:
    if value is None:  # an empty section (`rollout:` with every line commented out) means "all defaults"
        value = {}
    if not isinstance(value, dict):
        problems.add(path or "(top level)", f"expected a mapping of {cls.__name__} fields, got {yaml_kind(value)}")
        return _empty(cls)
    known = _fields(cls)
    names = {f.name for f, _ in known}
    for key in value:
        if key not in names:
            kpath = _join(path, str(key))
            problems.add(kpath, _unknown_key(kpath, key, cls), prefixed=False)
    kwargs = {}
    for f, tp in known:
        fpath = _join(path, f.name)
        if f.name in value:
            parsed = parse_value(tp, value[f.name], fpath, problems)
            if parsed is not _INVALID and _meets_constraints(f, parsed, fpath, problems):
                kwargs[f.name] = parsed
                continue
        elif not _is_required(f):
            continue
        else:
            problems.add(fpath, f"missing (required): {f.metadata['help']}")
        # An invalid value is replaced by the default (or a stand-in) so that later checks do not trip over it.
        kwargs[f.name] = _empty(tp) if _is_required(f) else field_default(f)
    return cls(**kwargs)


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_BOUND_TESTS = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}


def _meets_constraints(f: dataclasses.Field, value: Any, path: str, problems: Problems) -> bool:
    """Check the field's declared bounds, pattern and minimum length; record and return whether all hold."""
    meta = f.metadata
    why = f" ({meta['why']})" if "why" in meta else ""
    failed = []
    if value is not None:
        failed += [
            f"must be {op} {meta[key]}, got {value!r}{why}"
            for key, op in _BOUNDS
            if key in meta and not isinstance(value, str) and not _BOUND_TESTS[key](value, meta[key])  # not "auto"
        ]
        if "pattern" in meta and not re.fullmatch(meta["pattern"][0], value):
            failed.append(f"{value!r} is not valid; expected {meta['pattern'][1]}")
        if "min_items" in meta and len(value) < meta["min_items"]:
            failed.append(f"needs at least {meta['min_items']} item(s), got {len(value)}{why}")
    for message in failed:
        problems.add(path, message)
    return not failed


def _walk(cls: type, prefix: str = ""):
    """Yield (dotted path, field, type) for every field, depth first: a section, then its fields; a list of
    sections, then its items' fields (`members`, `members[].id`, ...)."""
    for f, tp in _fields(cls):
        path = _join(prefix, f.name)
        yield path, f, tp
        item = get_args(tp)[0] if get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            yield from _walk(tp, path)
        elif dataclasses.is_dataclass(item):
            yield from _walk(item, path + "[]")


def apply_override(raw: dict, text: str, problems: Problems) -> None:
    """Set one `dotted.key=value` (list items as `members.0.view` or `members[0].view`) in the raw mapping."""
    key, sep, value_text = text.partition("=")
    if not sep or not key:
        problems.add("", f"override {text!r}: expected dotted.key=value, e.g. rollout.n=8")
        return
    try:
        value = yaml.load(value_text, Loader=YamlLoader)
    except yaml.YAMLError as err:
        problems.add("", yaml_problem(f"override {text!r}", err))
        return
    parts = re.sub(r"\[(\d+)\]", r".\1", key.strip()).split(".")
    tp: Any = CohortConfig
    node: Any = raw
    path = ""
    for i, part in enumerate(parts):
        if dataclasses.is_dataclass(tp):
            hints = {f.name: h for f, h in _fields(tp)}
            if part not in hints:
                path = _join(path, part)
                problems.add(path, f"override {text!r}: {_unknown_key(path, part, tp)}", prefixed=False)
                return
            slot, child, path = part, hints[part], _join(path, part)
        elif get_origin(tp) is list:
            if not part.isdigit() or int(part) >= len(node):
                message = f"override {text!r}: {part!r} is not an index of {path} ({len(node)} item(s))"
                problems.add(path, message, prefixed=False)
                return
            slot, child, path = int(part), get_args(tp)[0], f"{path}[{part}]"
        else:  # a dict (loader options) or Any inside one: keys are free and may nest
            slot, child, path = part, Any, _join(path, part)
        if i == len(parts) - 1:
            node[slot] = value
            return
        # Descend, creating the sections the file left out; Optional[X] walks as X.
        if get_origin(child) in (Union, types.UnionType):
            child = next(a for a in get_args(child) if a is not type(None))
        if not (dataclasses.is_dataclass(child) or get_origin(child) in (list, dict) or child is Any):
            message = f"override {text!r}: {path} is {describe(child)}, it has no key {parts[i + 1]!r}"
            problems.add(path, message, prefixed=False)
            return
        container = list if get_origin(child) is list else dict
        current = node[slot] if isinstance(node, list) else node.get(slot)
        if current is None:
            current = node[slot] = container()
        if not isinstance(current, container):
            expected = yaml_kind(container())
            message = f"override {text!r}: {path} is a {yaml_kind(current)} in the file, not a {expected}"
            problems.add(path, message, prefixed=False)
            return
        tp, node = child, current


def flow_yaml(value: Any) -> str:
    """A value as YAML on one line (`0.3`, `true`, `null`, `[a, b]`): how messages write what a config holds."""
    # PyYAML ends a lone scalar document with an explicit "..." end marker.
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def explain() -> str:
    """Every field as `dotted.name: type = default`, then its doc and bounds on an indented line."""
    lines = []
    for path, f, tp in _walk(CohortConfig):
        if dataclasses.is_dataclass(tp):
            lines.append(f"{path}: section\n    {f.metadata['help']}")
            continue
        default = "(required)" if _is_required(f) else "= " + flow_yaml(field_default(f))
        bounds = ", ".join(f"{op} {f.metadata[k]}" for k, op in _BOUNDS if k in f.metadata)
        lines.append(f"{path}: {describe(tp)} {default}")
        lines.append(f"    {f.metadata['help']}" + (f" [{bounds}]" if bounds else ""))
    return "\n".join(lines)

"""Loading, validating and saving cohort configs: the public API re-exported by `vlm_corl.config`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vlm_corl.config.applies import inapplicable
from vlm_corl.config.engine_layout import VLLM_UNSUPPORTED, engine_layout_problems, member_engine, model_type
from vlm_corl.config.parse import (
    ConfigError,
    Problems,
    YamlLoader,
    apply_override,
    parse_value,
    yaml_kind,
    yaml_problem,
)
from vlm_corl.config.schema import PEER_MODES, CohortConfig, MemberConfig, custom_rewards, has_teachers
from vlm_corl.config.templates import chat_template_variables
from vlm_corl.errors import UserError
from vlm_corl.members.adapter_files import base_model_dir, is_adapter_dir
from vlm_corl.registry import BENCHMARKS, FAMILIES, LOADERS, REWARDS

# Strings a user means as booleans: a quoted "no" would switch a template's flag on (vlm_corl/config/loading.py)
_TRUE_WORDS = {"yes", "y", "true", "on", "1"}
_BOOLEAN_WORDS = _TRUE_WORDS | {"no", "n", "false", "off", "0"}


def validate(cfg: CohortConfig, processes: int | None = None) -> None:
    """Cross-field checks (the per-field ones run while parsing); raises ConfigError listing every problem.

    The engine layout (vLLM engines per rank, sleep mode) is checked for a launch of `processes`, or, when every
    member states its ranks, for the launch those ranks make; otherwise `train` checks it at start."""
    problems = Problems()
    _member_problems(cfg, problems)
    _run_problems(cfg, problems)
    _tracker_problems(cfg, problems)
    if not problems.items:
        _layout_problems(cfg, problems, processes)
    if problems.items:
        raise problems.error()


def _layout_problems(cfg: CohortConfig, problems: Problems, processes: int | None) -> None:
    """Placement and engine-layout problems of the launch, when its size is known (see `validate`)."""
    from vlm_corl.distributed.world import PlacementError, place_members

    given = processes is not None
    if not given:
        if not cfg.members or not all(m.ranks for m in cfg.members):
            return
        processes = max(r for m in cfg.members for r in m.ranks) + 1  # what the ranks imply
    try:
        placement = place_members(cfg.members, processes)
    except PlacementError as err:
        if given:  # otherwise `train` reports it against the launch it gets
            problems.add("members", str(err))
        return
    teachers = has_teachers(cfg)
    for path, message in engine_layout_problems(cfg, placement, teachers):
        problems.add(path, message)


def min_image_pixels(model_dir: Path) -> int | None:
    """The fewest pixels an image may have for a model whose processor puts it on a patch grid (Qwen-VL:
    patch_size x merge_size squared, one image token), from its processor or preprocessor config; None for
    processors that resize every image to their own tiles, or when the files cannot be read."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            found = json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            continue
        found = found.get("image_processor", found) if isinstance(found, dict) else {}
        if isinstance(found, dict) and isinstance(found.get("patch_size"), int) and found.get("merge_size"):
            return (found["patch_size"] * found["merge_size"]) ** 2
    return None


def _tracker_problems(cfg: CohortConfig, problems: Problems) -> None:
    """A tracker in logging.report_to whose package is missing (the message names the extra)."""
    from vlm_corl.training.monitor.trackers import PACKAGES, check_trackers

    for name in dict.fromkeys(n for n in cfg.logging.report_to if n in PACKAGES):  # bad names: already reported
        try:
            check_trackers([name])
        except UserError as err:
            problems.add("logging.report_to", str(err).removeprefix("logging.report_to: "))


def _member_problems(cfg: CohortConfig, problems: Problems) -> None:
    """Members: unique ids, model directories, engines, dtypes, LoRA, template kwargs, prompt styles, at least
    one trainable, enough for the reward's topology. Each member's problems are reported in that order, member by
    member, then the cohort's."""
    first_with: dict[str, int] = {}
    for i, m in enumerate(cfg.members):
        if m.id in first_with:
            problems.add(
                f"members[{i}].id",
                f"duplicate id {m.id!r} (also members[{first_with[m.id]}].id); give every member a unique id",
            )
        first_with.setdefault(m.id, i)
        model = _model_dir(i, m, problems)
        if model is None:  # a LoRA checkpoint whose base cannot be found: its other checks would only repeat it
            continue
        _model_problems(cfg, i, m, model, problems)
        _setting_problems(cfg, i, m, problems)
    _cohort_problems(cfg, problems)


def _model_dir(i: int, m: MemberConfig, problems: Problems) -> Path | None:
    """The model directory member `i` loads (a LoRA checkpoint's base), reporting one without a config.json;
    None, reported, when a LoRA checkpoint's base cannot be found."""
    model = Path(m.model)
    if is_adapter_dir(model):  # a LoRA checkpoint, merged into the base it names when loaded
        try:
            model = base_model_dir(model)
        except UserError as err:
            problems.add(f"members[{i}].model", str(err))
            return None
    if not (model / "config.json").is_file():
        state = "has no config.json" if model.is_dir() else "does not exist"
        problems.add(
            f"members[{i}].model",
            f"{m.model!r} {state}; it must be a local model directory with a config.json. Build tiny test models"
            f" with `corl zoo --out DIR` (then use DIR/<family>) or download one with"
            f" `huggingface-cli download ORG/NAME --local-dir DIR`",
        )
    return model


def _model_problems(cfg: CohortConfig, i: int, m: MemberConfig, model: Path, problems: Problems) -> None:
    """What member `i`'s model rules out: a vLLM engine for an architecture vLLM dropped, images smaller than
    its processor's patch grid."""
    kind = model_type(model)
    if member_engine(cfg, m) == "vllm" and kind in VLLM_UNSUPPORTED:
        problems.add(
            f"members[{i}].engine",
            f"member {m.id!r} is a {VLLM_UNSUPPORTED[kind]} model, which vLLM cannot run (it dropped "
            f"encoder-decoder models in 0.10.2): set members[{i}].engine: hf for this member (the others may "
            "stay on vLLM)",
        )
    _unread_template_kwargs(i, m, model, problems)
    smallest = min_image_pixels(model)
    if smallest is not None and cfg.data.max_image_pixels < smallest:
        problems.add(
            "data.max_image_pixels",
            f"{cfg.data.max_image_pixels} pixels is below the smallest image the processor of member {m.id!r} "
            f"takes ({smallest}: one {int(smallest**0.5)}x{int(smallest**0.5)}-pixel merged patch, one image "
            "token); raise it (the default holds 1,280 image tokens)",
        )


def _setting_problems(cfg: CohortConfig, i: int, m: MemberConfig, problems: Problems) -> None:
    """Member `i`'s own settings: a float16 trainable, LoRA the engine or a frozen peer cannot use, quoted
    booleans in its template kwargs, a prompt style reward.answer_style cannot read."""
    if m.trainable and m.dtype == "float16":
        problems.add(
            f"members[{i}].dtype",
            "float16 training needs loss scaling, which this trainer does not do: use bfloat16 or auto (a "
            "trainable member keeps fp32 master weights anyway; train.mixed_precision=bf16 for bf16 compute)",
        )
    if m.lora is not None and m.lora.vision and cfg.rollout.vllm.lora_sync == "adapter":
        if member_engine(cfg, m) == "vllm":
            problems.add(
                f"members[{i}].lora.vision",
                "vLLM serves adapters of the language model only: with adapters in the vision tower use "
                "rollout.vllm.lora_sync: merged",
            )
    _adapter_rank_problems(cfg, i, m, problems)
    if m.lora is not None and m.lora.target_modules == [] and not m.lora.vision:
        problems.add(
            f"members[{i}].lora.target_modules",
            "[] adapts no layer of the language model, and lora.vision is false: nothing would train; name "
            "layers (e.g. [q_proj, v_proj]), null for the default, or set lora.vision: true to adapt the vision "
            "tower alone",
        )
    _template_kwargs_problems(i, m, problems)
    if m.lora is not None and not m.trainable:
        problems.add(
            f"members[{i}].lora",
            "a frozen peer trains no adapters: remove lora, or set trainable: true (a frozen peer may load a "
            "LoRA checkpoint's adapter directory as its model: it is merged into its base)",
        )
    if cfg.reward.answer_style != "auto" and m.prompt_style not in (None, cfg.reward.answer_style):
        problems.add(
            "reward.answer_style",
            f"{cfg.reward.answer_style!r} cannot read members[{i}] answers (prompt_style {m.prompt_style!r});"
            " use reward.answer_style=auto or match the prompt styles",
        )


def _adapter_rank_problems(cfg: CohortConfig, i: int, m: MemberConfig, problems: Problems) -> None:
    """An adapter rank vLLM cannot serve under rollout.vllm.lora_sync: adapter (found here, not when the engine
    is built after the models load)."""
    if m.lora is None or cfg.rollout.vllm.lora_sync != "adapter" or member_engine(cfg, m) != "vllm":
        return
    from vlm_corl.members.engines.vllm import vllm_lora_rank  # torch: only for a LoRA member served by vLLM

    try:
        vllm_lora_rank(m.lora.r)
    except UserError as err:
        problems.add(f"members[{i}].lora.r", str(err).removeprefix(f"lora.r={m.lora.r}: "))


def _unread_template_kwargs(i: int, m: MemberConfig, model: Path, problems: Problems) -> None:
    """A key of member `i`'s chat_template_kwargs that its model's chat template never reads (a misspelling has
    no effect: the template renders as if it were not given)."""
    read = chat_template_variables(model) if m.chat_template_kwargs else None
    for key in (m.chat_template_kwargs or {}) if read is not None else ():
        if key not in read:
            problems.add(
                f"members[{i}].chat_template_kwargs.{key}",
                f"the chat template of {m.model} never reads {key!r}, so it changes nothing (the template "
                f"reads: {', '.join(sorted(read))}); fix the spelling or remove it",
            )


def _template_kwargs_problems(i: int, m: MemberConfig, problems: Problems) -> None:
    """Quoted booleans in member `i`'s chat_template_kwargs: any non-empty string is true in a template."""
    for key, value in (m.chat_template_kwargs or {}).items():
        if isinstance(value, str) and value.strip().lower() in _BOOLEAN_WORDS:
            problems.add(
                f"members[{i}].chat_template_kwargs.{key}",
                f"the string {value!r} is true in a chat template (any non-empty string is): write "
                f"{key}: {str(value.strip().lower() in _TRUE_WORDS).lower()}, a YAML boolean, without quotes",
            )


def _cohort_problems(cfg: CohortConfig, problems: Problems) -> None:
    """The members together: at least one trainable, enough of them for the reward's topology."""
    members, mode, n_members = cfg.members, cfg.reward.mode, len(cfg.members)
    if members and not any(m.trainable for m in members):
        problems.add(
            "members", "every member has trainable: false, so nothing would train; set trainable: true on at least one"
        )

    _custom_problems(cfg, problems)
    if members:
        if mode in PEER_MODES and n_members < 2:
            problems.add(
                "reward.mode",
                f"{mode!r} rewards each member with its peers' answers and needs at least 2 members"
                f" (got {n_members}); add a member or use a single-model mode"
                " (self_vote, self_certainty, entropy, gt, co_rewarding_1, co_rewarding_2)",
            )


CUSTOM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*")


def _custom_problems(cfg: CohortConfig, problems: Problems) -> None:
    """reward.custom names module:function reward functions; reward.weights gives one weight per function."""
    custom = custom_rewards(cfg)
    for i, name in enumerate(custom):
        if not CUSTOM_NAME.fullmatch(name):
            path = "reward.custom" if isinstance(cfg.reward.custom, str) else f"reward.custom[{i}]"
            problems.add(path, f"{name!r} is not valid; expected module:function, e.g. my_pkg.rewards:score")
    weights = cfg.reward.weights
    if weights is not None and len(weights) != len(custom):
        problems.add(
            "reward.weights", f"{len(weights)} weight(s) for {len(custom)} reward.custom function(s); give one each"
        )


def config_warnings(cfg: CohortConfig) -> list[str]:
    """What a valid config runs as but likely does not mean: warned by `train` at start and by `corl config`
    alike. `peers` over two members is `ring` (each member's only peer labels it); a field set to a non-default
    value that does not apply in this config (`vlm_corl.config.applies.RULES`) gets one warning naming it, the
    setting that would make it apply and what the run does instead."""
    warnings = [message for _, message in inapplicable(cfg)]
    if cfg.reward.mode == "peers" and len(cfg.members) == 2:
        warnings.append(
            "reward.mode peers with 2 members equals ring (each member's only peer labels it); it runs as given"
        )
    return warnings


def _run_problems(cfg: CohortConfig, problems: Problems) -> None:
    """The rest of the run: DeepSpeed, evaluation, engines, the off-policy correction, the overlong window,
    referenced files."""
    if cfg.train.deepspeed is not None:
        for problem in deepspeed_problems(cfg.train.deepspeed):
            problems.add("train.deepspeed", problem)
    if cfg.eval.every > 0 and not cfg.eval.benchmarks:
        problems.add(
            "eval.benchmarks",
            f"eval.every={cfg.eval.every} but no benchmark is listed; add names or set eval.every=0",
        )
    if cfg.eval.keep_best is not None and (cfg.eval.keep_best not in cfg.eval.benchmarks or cfg.eval.every == 0):
        problems.add(
            "eval.keep_best",
            f"{cfg.eval.keep_best!r} ranks the in-loop evaluations, so it must be one of eval.benchmarks "
            f"({', '.join(cfg.eval.benchmarks) or 'none'}) with eval.every > 0",
        )
    if cfg.rollout.vllm.tensor_parallel_size > 1:
        problems.add(
            "rollout.vllm.tensor_parallel_size",
            "tensor-parallel vLLM engines are not supported: the engine runs inside each training process "
            "(weights pass by reference), and vLLM's torchrun launcher would span the whole job, not one member's "
            "ranks. Use 1: one engine per rank, each rolling out its share of the batch",
        )
    if cfg.algo.rollout_is != "none" and (cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0):
        problems.add(
            "algo.rollout_is",
            "importance weights compare the trainer's and the engine's probabilities of the full tempered "
            "distribution, which top-p/top-k truncation changes: set rollout.top_p=1.0 and rollout.top_k=0, or "
            "algo.rollout_is=none",
        )
    if cfg.algo.overlong_penalty > cfg.rollout.max_new_tokens:
        problems.add(
            "algo.overlong_penalty",
            f"the overlong window ({cfg.algo.overlong_penalty} tokens) is longer than the budget it ends "
            f"(rollout.max_new_tokens={cfg.rollout.max_new_tokens}); set it to at most that, or 0 (off)",
        )
    for path, value in (("data.paraphrases", cfg.data.paraphrases),):
        if value is not None and not Path(value).is_file():
            problems.add(path, f"file {value!r} does not exist; fix the path or set it to null")


def deepspeed_problems(path: str) -> list[str]:
    """What stops `train.deepspeed` from working: a missing file, bad JSON, settings we drive, no deepspeed."""
    from vlm_corl.members.deepspeed_update import DeepSpeedConfigError, load_deepspeed_config

    if not Path(path).is_file():
        return [
            f"file {path!r} does not exist; name a DeepSpeed JSON config (e.g. configs/deepspeed/zero2.json)"
            " or set it to null"
        ]
    try:
        load_deepspeed_config(path, grad_clip=1.0, group_size=1, autocast=None)
    except DeepSpeedConfigError as err:
        return [str(err)]
    except ValueError as err:
        return [f"{path} is not valid JSON ({err})"]
    if importlib.util.find_spec("deepspeed") is None:
        return ["DeepSpeed is not installed: `DS_BUILD_OPS=0 pip install -e '.[deepspeed]'`, or set it to null"]
    return []


def check_registered(cfg: CohortConfig) -> None:
    """Resolve registry names (data loader, member families) at run time, after extensions are imported.

    Loading does not check these names: the registries fill up only when `vlm_corl`'s data/family modules,
    `text_corl` or a user's package are imported, which the config layer must not do itself.
    """
    import vlm_corl.training.rewards.modes  # noqa: F401  (registers the built-in reward modes)

    problems = Problems()
    lookups = [("data.train.loader", LOADERS, cfg.data.train.loader)]
    lookups += [("reward.mode", REWARDS, cfg.reward.mode)]
    single = isinstance(cfg.reward.custom, str)
    lookups += [
        ("reward.custom" if single else f"reward.custom[{i}]", REWARDS, name)
        for i, name in enumerate(custom_rewards(cfg))
    ]
    lookups += [("eval.benchmarks", BENCHMARKS, name) for name in cfg.eval.benchmarks]
    lookups += [
        (f"members[{i}].family", FAMILIES, m.family)
        for i, m in enumerate(cfg.members)
        if m.family and m.family != "generic"  # the generic family serves per checkpoint, unregistered
    ]
    for path, registry, name in lookups:
        try:
            registry.get(name)  # reward.custom's functions are checked against their contract when the run starts
        except (KeyError, ImportError, AttributeError, UserError) as err:  # a benchmark file's mistakes too
            problems.add(path, str(err))
    if problems.items:
        raise problems.error()


def config_from_dict(d: Any, processes: int | None = None) -> CohortConfig:
    """Build and validate a CohortConfig from plain data (a parsed YAML mapping), for a launch of `processes`
    when given (see `validate`); raises ConfigError."""
    problems = Problems()
    cfg = parse_value(CohortConfig, d, "", problems)
    try:
        validate(cfg, processes)
    except ConfigError as err:
        for path, message in zip(err.fields, err.problems):
            if not problems.covers(path):
                problems.items.append((path, message))
    if problems.items:
        raise problems.error()
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = (), processes: int | None = None) -> CohortConfig:
    """Read a cohort YAML file, apply dotted `key=value` overrides, and return the validated config (for a launch
    of `processes` when given: the placement and engine layout too).

    Raises ConfigError naming every problem: unreadable or invalid YAML (with line and column), a top level that
    is not a mapping, bad overrides, and everything `config_from_dict` reports.
    """
    problems = Problems()
    raw = read_raw_config(path, overrides, problems)
    try:
        cfg = config_from_dict(raw, processes)
    except ConfigError as err:
        problems.items += list(zip(err.fields, err.problems))
    if problems.items:
        raise problems.error()
    return cfg


def read_raw_config(path: str | Path, overrides: Sequence[str] = (), problems: Problems | None = None) -> dict:
    """The YAML mapping of a cohort file with the overrides applied, before validation. Unreadable or invalid
    YAML raises ConfigError; override problems go to `problems` (raised here when it is not given)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError([f"{path}: cannot read the config file ({err.strerror or err})"]) from None
    except UnicodeDecodeError as err:  # a binary file, or text saved in another encoding
        raise ConfigError(
            [
                f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}): a cohort file "
                "is YAML saved as UTF-8; is it the right file?"
            ]
        ) from None
    try:
        raw = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as err:
        raise ConfigError([yaml_problem(str(path), err)]) from None
    if raw is None:
        raw = {}  # an empty file: the missing `members` is reported like any other required field
    if not isinstance(raw, dict):
        raise ConfigError(
            [f"{path}: the top level must be a mapping of sections (members, data, ...), got a {yaml_kind(raw)}"]
        )
    resolve_beside(raw, Path(path).parent)
    return with_overrides(raw, overrides, problems)


# The fields that name an input file or directory (a model, data, a cache, a DeepSpeed config): the YAML keys
# down to the mapping that holds it (`members` is a list of mappings), and its key there.
INPUT_PATHS = ((("members",), "model"), (("data", "train"), "path"), (("data",), "paraphrases"),
               (("train",), "deepspeed"))  # fmt: skip


def resolve_beside(raw: dict, folder: Path) -> None:
    """Relative input paths written in a cohort file (`INPUT_PATHS`) are looked up beside the file first: where
    the path exists there, it is rewritten to that place, so a recipe plans and trains from any working
    directory (`../deepspeed/zero2.json` in configs/cohorts/); otherwise it is left to the working directory, as
    before (`models/...`, `out/demo/base/...` written from the project's root). Overrides given on the command
    line are not rewritten: they are read from the working directory."""
    for keys, key in INPUT_PATHS:
        holders = [raw]
        for k in keys:
            holders = [h.get(k) for h in holders if isinstance(h, dict)]
            holders = [x for h in holders for x in (h if isinstance(h, list) else [h])]
        for holder in holders:
            value = holder.get(key) if isinstance(holder, dict) else None
            if isinstance(value, str) and value and not Path(value).is_absolute() and (folder / value).exists():
                holder[key] = os.path.normpath(folder / value)


def with_overrides(raw: dict, overrides: Sequence[str], problems: Problems | None = None) -> dict:
    """`raw` (a config mapping, changed in place) with dotted `key=value` overrides applied; their problems go to
    `problems`, or are raised as ConfigError when it is not given."""
    own = problems if problems is not None else Problems()
    for text_override in overrides:
        apply_override(raw, text_override, own)
    if problems is None and own.items:
        raise own.error()
    return raw


def config_to_dict(cfg: CohortConfig) -> dict:
    """The config as plain data (every field, defaults included), fit for YAML/JSON."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: CohortConfig) -> str:
    """The config as YAML text, fields in declaration order."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: CohortConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (the run directory's config.yaml); `load_config` reads it back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(cfg))

"""When each config field applies (vlm_corl.config.applies): every schema field is always applied, refused where
it would not apply, or has a rule; each rule warns where its field is set and does not apply, and only there. Also
the refusals of combinations that mean nothing, and other tools' names for our settings (issue 56)."""

import copy
import dataclasses
import importlib.util
import json
import types
from typing import Union, get_args, get_origin, get_type_hints

import pytest
import yaml

from vlm_corl.config import CohortConfig, ConfigError, MemberConfig, config_from_dict
from vlm_corl.config.applies import ALWAYS, REFUSED, RULES, markdown_table
from vlm_corl.config.loading import config_warnings
from vlm_corl.config.parse import OTHER_NAMES

ZERO2 = {"zero_optimization": {"stage": 2}}
ZERO3 = {"zero_optimization": {"stage": 3}}
VLLM = {"rollout": {"engine": "vllm"}}
EVAL = {"eval": {"every": 5, "benchmarks": ["easyvqa"]}}


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Run in tmp_path, with (fake) model dirs out/zoo/a and out/zoo/b, DeepSpeed configs zero2.json and
    zero3.json, and a paraphrase cache para.jsonl."""
    monkeypatch.chdir(tmp_path)
    for name in "ab":
        (tmp_path / "out/zoo" / name).mkdir(parents=True)
        (tmp_path / "out/zoo" / name / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "zero2.json").write_text(json.dumps(ZERO2))
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    (tmp_path / "para.jsonl").write_text("")
    return tmp_path


def members(a=None, b=None):
    """The two members a and b, each with the given extra fields."""
    return {"members": [{"id": "a", "model": "out/zoo/a", **(a or {})}, {"id": "b", "model": "out/zoo/b", **(b or {})}]}


def raw(*parts):
    """A two-member config: the parts merged section by section (a later part's `members` replaces the list)."""
    out = members()
    for part in parts:
        for key, value in copy.deepcopy(part).items():
            out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def algo(**fields):
    return {"algo": fields}


# Per rule: (a config where its field is set and does not apply, one where it is set and applies).
CASES = {
    "algo.clip_low": (algo(clip_low=0.3, policy_loss="gspo"), algo(clip_low=0.3)),
    "algo.clip_high": (algo(clip_high=0.28, policy_loss="cispo"), algo(clip_high=0.28)),
    "algo.gspo_clip_low": (algo(gspo_clip_low=1e-3), algo(gspo_clip_low=1e-3, policy_loss="gspo")),
    "algo.gspo_clip_high": (
        algo(gspo_clip_high=1e-3, policy_loss="sapo"),
        algo(gspo_clip_high=1e-3, policy_loss="gspo"),
    ),
    "algo.cispo_max_weight": (algo(cispo_max_weight=4.0), algo(cispo_max_weight=4.0, policy_loss="cispo")),
    "algo.sapo_tau_pos": (algo(sapo_tau_pos=2.0), algo(sapo_tau_pos=2.0, policy_loss="sapo")),
    "algo.sapo_tau_neg": (algo(sapo_tau_neg=2.0, policy_loss="gspo"), algo(sapo_tau_neg=2.0, policy_loss="sapo")),
    "algo.kl_estimator": (algo(kl_estimator="k1"), algo(kl_estimator="k1", kl_beta=0.1)),
    "algo.drgrpo_norm": (algo(drgrpo_norm=64), algo(drgrpo_norm=64, loss_agg="drgrpo")),
    "algo.adv_eps": (algo(adv_eps=1e-4, scale_rewards="none"), algo(adv_eps=1e-4, scale_rewards="batch")),
    "algo.resample_max_rounds": (algo(resample_max_rounds=5), algo(resample_max_rounds=5, resample_zero_variance=True)),
    "algo.overlong_penalty_factor": (
        algo(overlong_penalty_factor=0.5),
        algo(overlong_penalty_factor=0.5, overlong_penalty=16),
    ),
    "algo.rollout_is_cap": (algo(rollout_is_cap=3.0), algo(rollout_is_cap=3.0, rollout_is="token_mask")),
    "algo.rollout_is_max_abs_dlogp": (
        algo(rollout_is_max_abs_dlogp=0.5),
        algo(rollout_is_max_abs_dlogp=0.5, rollout_is="sequence_truncated"),
    ),
    "rollout.vllm.gpu_memory_utilization": (
        {"rollout": {"vllm": {"gpu_memory_utilization": 0.3}}},
        {"rollout": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.3}}},
    ),
    "rollout.vllm.enforce_eager": (
        {"rollout": {"vllm": {"enforce_eager": True}}},
        {**members(b={"engine": "vllm"}), "rollout": {"vllm": {"enforce_eager": True}}},
    ),
    "rollout.vllm.enable_sleep_mode": (
        {"rollout": {"vllm": {"enable_sleep_mode": True}}},
        {"rollout": {"engine": "vllm", "vllm": {"enable_sleep_mode": True}}},
    ),
    "rollout.vllm.kv_cache_memory_bytes": (
        {"rollout": {"vllm": {"kv_cache_memory_bytes": 1 << 30}}},
        {"rollout": {"engine": "vllm", "vllm": {"kv_cache_memory_bytes": 1 << 30}}},
    ),
    "rollout.vllm.sleep_level": (  # vLLM, but sleep mode off
        {"rollout": {"engine": "vllm", "vllm": {"sleep_level": 1}}},
        {"rollout": {"engine": "vllm", "vllm": {"sleep_level": 1, "enable_sleep_mode": True}}},
    ),
    "rollout.vllm.lora_sync": (  # a LoRA member, but on HF
        {**members(a={"lora": {}}, b={"engine": "vllm"}), "rollout": {"vllm": {"lora_sync": "adapter"}}},
        {**members(a={"lora": {}, "engine": "vllm"}), "rollout": {"vllm": {"lora_sync": "adapter"}}},
    ),
    "rollout.hf_static_cache": (
        {"rollout": {"engine": "vllm", "hf_static_cache": "off"}},
        {**members(a={"engine": "hf"}), "rollout": {"engine": "vllm", "hf_static_cache": "off"}},
    ),
    "reward.teacher_decay_start": (
        {"reward": {"teacher_decay_start": 0.95}},
        {"reward": {"teacher_decay_start": 0.95, "mode": "co_rewarding_2"}},
    ),
    "reward.teacher_decay_end": (
        {"reward": {"teacher_decay_end": 0.999, "mode": "peers"}},
        {"reward": {"teacher_decay_end": 0.999, "mode": "peers_ema"}},
    ),
    "reward.weights": ({"reward": {"weights": []}}, {"reward": {"weights": [2.0], "custom": "pkg.mod:fn"}}),
    "reward.format_weight": (
        {"reward": {"format_weight": 0.5, "mode": "self_certainty"}},
        {"reward": {"format_weight": 0.5, "mode": "gt"}},
    ),
    "train.lr": (
        {**members(a={"lr": 1e-5}, b={"trainable": False}), "train": {"lr": 3e-6}},
        {**members(a={"lr": 1e-5}), "train": {"lr": 3e-6}},
    ),
    "train.gather_bucket_mb": (
        {"train": {"gather_bucket_mb": 256.0, "deepspeed": "zero2.json"}},
        {"train": {"gather_bucket_mb": 256.0, "deepspeed": "zero3.json"}},
    ),
    "train.async_checkpoint": (
        {"train": {"async_checkpoint": True, "deepspeed": "zero2.json"}},
        {"train": {"async_checkpoint": True}},
    ),
    "train.keep_last": (
        {"train": {"keep_last": 5, "save_every": 0, "save_last": False}},
        {"train": {"keep_last": 5, "save_every": 0}},
    ),
    "train.overwrite": (
        {"train": {"overwrite": True, "resume": True}},
        {"train": {"overwrite": True, "resume": "auto"}},
    ),
    "train.device_memory_gb": (
        {"train": {"device_memory_gb": 80.0, "check_memory": "off"}},
        {"train": {"device_memory_gb": 80.0, "check_memory": "warn"}},
    ),
    "eval.benchmarks": ({"eval": {"benchmarks": ["easyvqa"]}}, EVAL),
    "eval.limit": ({"eval": {"limit": 10}}, raw(EVAL, {"eval": {"limit": 10}})),
    "eval.temperature": ({"eval": {"temperature": 0.5}}, raw(EVAL, {"eval": {"temperature": 0.5}})),
    "eval.max_new_tokens": ({"eval": {"max_new_tokens": 32}}, raw(EVAL, {"eval": {"max_new_tokens": 32}})),
    "eval.max_category_drop": ({"eval": {"max_category_drop": 0.3}}, raw(EVAL, {"eval": {"max_category_drop": 0.3}})),
    "logging.samples_per_step": (
        {"logging": {"samples_per_step": 4, "samples_every": 0}},
        {"logging": {"samples_per_step": 4}},
    ),
    "logging.category_window": (
        {"logging": {"category_window": 5, "category_key": None}},
        {"logging": {"category_window": 5, "category_key": "question_type"}},
    ),
    "logging.tracker_timeout_s": (
        {"logging": {"tracker_timeout_s": 60.0, "report_to": []}},
        {"logging": {"tracker_timeout_s": 60.0}},
    ),
    "data.paraphrases": (
        {"data": {"paraphrases": "para.jsonl"}},
        {**members(b={"view": "paraphrase:1"}), "data": {"paraphrases": "para.jsonl"}},
    ),
    "data.view_fallback": (
        {"data": {"view_fallback": "original"}},
        {"data": {"view_fallback": "original"}, "reward": {"mode": "co_rewarding_1"}},
    ),
    "members[].lr": (members(b={"lr": 1e-5, "trainable": False}), members(b={"lr": 1e-5})),
}

# Per field validate refuses where it would not apply: a config where it would not, and the field refused.
REFUSED_CASES = {
    "rollout.vllm.tensor_parallel_size": (
        {"rollout": {"engine": "vllm", "vllm": {"tensor_parallel_size": 2}}},
        "rollout.vllm.tensor_parallel_size",
    ),
    "eval.keep_best": ({"eval": {"benchmarks": ["easyvqa"], "keep_best": "easyvqa"}}, "eval.keep_best"),
    "members[].lora": (members(b={"lora": {}, "trainable": False}), "members[1].lora"),
}


def schema_fields(cls=CohortConfig, prefix=""):
    """Every field's dotted path, into sections, list items (`members[].id`) and optional sections
    (`members[].lora.r`)."""
    for f in dataclasses.fields(cls):
        tp = get_type_hints(cls)[f.name]
        path = f"{prefix}{f.name}"
        yield path
        if get_origin(tp) in (Union, types.UnionType):
            tp = next(a for a in get_args(tp) if a is not type(None))
        if get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0]):
            yield from schema_fields(get_args(tp)[0], path + "[].")
        elif dataclasses.is_dataclass(tp):
            yield from schema_fields(tp, path + ".")


def test_every_schema_field_applies_always_or_has_a_rule_with_its_test():
    """A new field must say when it applies: in ALWAYS, REFUSED, or a rule of RULES (and its case here)."""
    ruled = [r.field for r in RULES]
    assert len(ruled) == len(set(ruled)), "one rule per field"
    fields = set(schema_fields())
    assert "members[].lora.vision" in fields and "rollout.vllm.sleep_level" in fields  # the walk reaches them
    kinds = [ALWAYS, set(REFUSED), set(ruled)]
    assert fields == set().union(*kinds), f"fields without a rule: {sorted(fields - set().union(*kinds))}"
    assert sum(map(len, kinds)) == len(fields), "a field is in more than one of ALWAYS, REFUSED, RULES"
    assert set(CASES) == set(ruled) and set(REFUSED_CASES) == set(REFUSED)


def _member(field: str, cfg: CohortConfig) -> int | None:
    """For a member's field (`members[].lr`), the index of the member who set it away from its default."""
    if not field.startswith("members[]."):
        return None
    name = field.removeprefix("members[].")
    default = MemberConfig.__dataclass_fields__[name].default
    return next(i for i, m in enumerate(cfg.members) if getattr(m, name) != default)


def _path(field: str, cfg: CohortConfig) -> str:
    """The warning's name for `field`: a member's field is that of the member who set it (members[1].lr)."""
    i = _member(field, cfg)
    return field if i is None else field.replace("members[]", f"members[{i}]")


def _named(warnings: list[str], path: str) -> list[str]:
    return [w for w in warnings if w.startswith(f"{path}=")]


@pytest.mark.parametrize("field", sorted(CASES))
def test_a_field_that_does_not_apply_warns_once_and_one_that_applies_never(models, field):
    if "deepspeed" in json.dumps(CASES[field]) and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("train.deepspeed is refused without DeepSpeed installed")
    fails, holds = (config_from_dict(raw(part)) for part in CASES[field])
    path = _path(field, fails)
    warned = config_warnings(fails)
    assert len(_named(warned, path)) == 1, warned
    (warning,) = _named(warned, path)
    rule, i = next(r for r in RULES if r.field == field), _member(field, fails)
    needs = rule.needs.format(cfg=fails, i=i, m=None if i is None else fails.members[i])
    assert " does not apply " in warning and warning.endswith(f"(set {needs} to use it)")
    assert _default(field) not in (_value(holds, _path(field, holds)), _value(fails, path))  # set in both
    assert _named(config_warnings(holds), _path(field, holds)) == []


def _value(cfg: CohortConfig, path: str):
    obj = cfg
    for part in path.replace("[", ".").replace("]", "").split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _default(field: str):
    """The schema's default of a dotted field (`members[].lr`: a member's)."""
    *sections, name = field.split(".")
    cls = MemberConfig if sections == ["members[]"] else CohortConfig
    for section in sections if cls is CohortConfig else ():
        cls = get_type_hints(cls)[section]
    f = cls.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_the_warning_says_what_applies_instead(models):
    warned = config_warnings(config_from_dict(raw(algo(clip_low=0.3, policy_loss="gspo"))))
    assert warned == [
        "algo.clip_low=0.3 does not apply under algo.policy_loss=gspo: gspo clips each sequence's ratio with "
        "algo.gspo_clip_low/gspo_clip_high (set algo.policy_loss=grpo to use it)"
    ]
    frozen = config_warnings(config_from_dict(members(b={"lr": 1e-5, "trainable": False})))
    assert frozen == [
        "members[1].lr=1.0e-05 does not apply on frozen member 'b' (members[1].trainable=false): a frozen peer "
        "never updates (set members[1].trainable=true to use it)"
    ]


def test_defaults_and_values_that_ask_for_what_the_run_does_anyway_never_warn(models):
    assert config_warnings(config_from_dict(raw())) == []
    # every field of the failing configs back at its default: nothing warns (the rules' switches are set there)
    off = raw(
        {"eval": {"max_category_drop": None}},  # no in-loop evaluation, and no drop flag asked for
        algo(overlong_penalty_factor=0.0, rollout_is_max_abs_dlogp=0.0),  # no penalty, no guard: as without them
    )
    assert config_warnings(config_from_dict(off)) == []
    if importlib.util.find_spec("deepspeed") is not None:
        sync = raw({"train": {"async_checkpoint": False, "deepspeed": "zero2.json"}})
        assert config_warnings(config_from_dict(sync)) == []


@pytest.mark.parametrize("field", sorted(REFUSED_CASES))
def test_refused_fields_are_refused_where_they_would_not_apply(models, field):
    part, path = REFUSED_CASES[field]
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw(part))
    assert info.value.fields == [path]


def test_an_adapter_rank_vllm_cannot_serve_is_refused_before_any_model_loads(models):
    lora = raw(members(a={"lora": {"r": 600}, "engine": "vllm"}), {"rollout": {"vllm": {"lora_sync": "adapter"}}})
    with pytest.raises(ConfigError) as info:
        config_from_dict(lora)
    assert info.value.problems == [
        "members[0].lora.r: vLLM serves adapters up to rank 512; use rollout.vllm.lora_sync: merged"
    ]
    merged = copy.deepcopy(lora)
    merged["rollout"]["vllm"]["lora_sync"] = "merged"  # the merged weights are pushed: any rank
    assert config_from_dict(merged).members[0].lora.r == 600


@pytest.mark.parametrize("field, value", sorted(OTHER_NAMES, key=str))
def test_other_tools_names_point_to_the_setting_that_gives_them(models, field, value):
    section, name = field.split(".")
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw({section: {name: value}}))
    (problem,) = info.value.problems
    what, setting = OTHER_NAMES[field, value]
    assert problem.startswith(f"{field}: {value!r} is not valid; choose one of:")
    assert problem.endswith(f"({what}: set {setting})") and "did you mean" not in problem


def test_dapo_points_to_the_token_mean_aggregation_not_sapo(models):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw(algo(policy_loss="dapo")))
    (problem,) = info.value.problems
    assert "set algo.loss_agg=token_mean" in problem and "sapo'?" not in problem
    with pytest.raises(ConfigError) as info:  # a plain misspelling still gets the closest name
        config_from_dict(raw(algo(policy_loss="gpso")))
    assert info.value.problems[0].endswith("(did you mean 'gspo'?)")


def test_corl_config_prints_the_warning(models, capsys):
    from vlm_corl.config.__main__ import main as config_main

    (models / "c.yaml").write_text(yaml.safe_dump(raw(algo(resample_max_rounds=5))))
    assert config_main(["c.yaml"]) == 0
    err = capsys.readouterr().err
    assert "warning: algo.resample_max_rounds=5 does not apply with algo.resample_zero_variance=false" in err


def test_docs_hold_the_table_of_rules():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    assert markdown_table() in text, (
        "paste `python -c 'from vlm_corl.config.applies import markdown_table as t; print(t())'` into "
        "docs/training.md (When a setting applies)"
    )

"""The typed cohort config: defaults, round trip, every validation rule (messages included), overrides, the CLI."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import pytest
import yaml

from vlm_corl.config import (
    CohortConfig,
    ConfigError,
    MemberConfig,
    check_registered,
    config_from_dict,
    config_to_dict,
    explain,
    load_config,
    save_config,
    validate,
)
from vlm_corl.registry import LOADERS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Run in tmp_path, where out/zoo/a, out/zoo/b, out/zoo/c are (fake) model dirs with a config.json."""
    monkeypatch.chdir(tmp_path)
    for name in "abc":
        (tmp_path / "out/zoo" / name).mkdir(parents=True)
        (tmp_path / "out/zoo" / name / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return tmp_path


def cohort(n=2, **sections):
    """A raw config dict with n members (ids a, b, c) plus the given sections."""
    members = [{"id": name, "model": f"out/zoo/{name}"} for name in "abc"[:n]]
    return {"members": members, **sections}


def problems(raw=None, overrides=(), path=None):
    """The problems reported for a raw dict (written to a file when overrides are given) or a file."""
    if path is None and overrides:
        path = Path("cfg.yaml")
        path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides) if path is not None else config_from_dict(raw)
    return info.value.problems


def one_problem(raw=None, overrides=(), path=None):
    """The single problem reported (fails if there are more)."""
    found = problems(raw, overrides, path)
    assert len(found) == 1, found
    return found[0]


# ----------------------------------------------------------------------------------------------- schema


def sections(cls=CohortConfig):
    """Every config dataclass reachable from `cls`, `cls` first."""
    yield cls
    for tp in get_type_hints(cls).values():
        item = get_args(tp)[0] if get_origin(tp) is list else tp
        if dataclasses.is_dataclass(item):
            yield from sections(item)


def test_every_field_has_a_one_line_doc_and_explain_lists_it():
    text = explain()
    assert len(list(sections())) == 11
    for cls in sections():
        for f in dataclasses.fields(cls):
            doc = f.metadata.get("help", "")
            assert doc and "\n" not in doc, f"{cls.__name__}.{f.name} needs a one-line help"
            assert f"\n    {doc}" in text, f"{cls.__name__}.{f.name} missing from --explain"
    assert (
        "rollout.vllm.gpu_memory_utilization: a number = 0.5\n    share of GPU memory the vLLM engines of one "
        "process may take in all (split evenly among them) [> 0, <= 1]" in (text)
    )
    assert "members[].view: a string = original" in text
    assert "members[].model: a string (required)" in text
    assert "train.resume: true or false or auto = false" in text


def test_defaults_come_from_the_dataclasses(models):
    cfg = config_from_dict(cohort())
    assert cfg.rollout.n == 4 and cfg.rollout.temperature == 1.0 and cfg.rollout.vllm.gpu_memory_utilization == 0.5
    assert cfg.reward.mode == "ring" and cfg.algo.loss_agg == "token_mean" and cfg.train.lr == 1e-6
    assert cfg.members[0] == MemberConfig(id="a", model="out/zoo/a")
    assert cfg.data.train.options == {} and cfg.rollout.stop == [] and cfg.train.resume is False


def test_round_trip_load_save_load(models):
    raw = cohort(
        3,
        name="rt",
        data={"train": {"loader": "pkg.mod:load", "options": {"k": [1, 2]}, "limit": 10}, "batch_size": 4},
        rollout={"n": 8, "stop": ["</answer>"], "vllm": {"enforce_eager": True}},
        reward={"mode": "peers", "vote_threshold": 0.5},
        algo={"loss_agg": "drgrpo", "drgrpo_norm": 512},
        train={"lr": 1, "resume": "auto"},  # an int where a float is expected is accepted
        eval={"benchmarks": ["mathvista"], "every": 10},
    )
    raw["members"][1].update(view="paraphrase:2", trainable=False, lr=3e-6, prompt_style="answer_tags")
    Path("in.yaml").write_text(yaml.safe_dump(raw))
    first = load_config("in.yaml")
    assert first.train.lr == 1.0 and isinstance(first.train.lr, float)
    save_config(first, "run/nested/config.yaml")
    second = load_config("run/nested/config.yaml")
    assert second == first
    assert config_to_dict(second) == config_to_dict(first)


def test_yaml_1_2_scalars(models):
    """`lr: 1e-6` is a float and `mixed_precision: no` the string 'no' (YAML 1.1 would say string and false)."""
    members = "members: [{id: a, model: out/zoo/a}, {id: b, model: out/zoo/b}]\n"
    Path("c.yaml").write_text(members + "train: {lr: 1e-6, mixed_precision: no}\n")
    cfg = load_config("c.yaml", ["rollout.temperature=7E-1", "logging.progress=false"])
    assert cfg.train.lr == 1e-6 and cfg.rollout.temperature == 0.7 and cfg.train.mixed_precision == "no"
    assert cfg.logging.progress is False
    save_config(cfg, "saved.yaml")
    assert load_config("saved.yaml") == cfg
    assert one_problem(cohort(), ["logging.progress=yes"]) == (
        "logging.progress: expected true or false, got string 'yes'"
    )


@pytest.mark.parametrize("name", ["example_text.yaml", "example_vlm.yaml"])
def test_example_configs_parse(name, tmp_path, monkeypatch):
    path = ROOT / "configs/cohorts" / name
    monkeypatch.chdir(tmp_path)
    for member in yaml.safe_load(path.read_text())["members"]:
        Path(member["model"]).mkdir(parents=True)
        (Path(member["model"]) / "config.json").write_text("{}")
    cfg = load_config(path)
    assert len(cfg.members) >= 2 and all(m.model.startswith("out/zoo/") for m in cfg.members)


# ----------------------------------------------------------------------------------------------- per-field rules


def test_a_renamed_or_removed_key_names_its_new_spelling(models):
    """A cohort file written for an earlier version: the old key's message says what to write instead
    (vlm_corl.config.renamed), in the file and in dotted overrides."""
    assert one_problem(cohort(logging={"tensorboard": False})).startswith(
        "'logging.tensorboard' was renamed or removed; use logging.report_to: write `report_to: [tensorboard]`"
    )
    raw = cohort()
    raw["members"][1]["num_processes"] = 2
    assert one_problem(raw).startswith("'members[1].num_processes' was renamed or removed; use members[].ranks")


def test_the_renamed_table_names_no_live_field():
    """A row for a key that exists again would hide it behind a wrong message; and each row says what to do."""
    from vlm_corl.config.parse import _walk
    from vlm_corl.config.renamed import RENAMED

    live = {path for path, _, _ in _walk(CohortConfig)}
    assert RENAMED and not set(RENAMED) & live
    assert all(instead.split(":", 1)[0].split(" ")[0] in live for instead in RENAMED.values())  # the new key exists


def test_a_quoted_boolean_for_a_template_switch_is_refused(models):
    """`enable_thinking: "no"` (quoted) reaches the template as a non-empty string, which is true there."""
    raw = cohort()
    raw["members"][0]["chat_template_kwargs"] = {"enable_thinking": "no", "name": "x"}
    assert one_problem(raw) == (
        "members[0].chat_template_kwargs.enable_thinking: the string 'no' is true in a chat template (any "
        "non-empty string is): write enable_thinking: false, a YAML boolean, without quotes"
    )
    raw["members"][0]["chat_template_kwargs"] = {"enable_thinking": False}
    assert config_from_dict(raw).members[0].chat_template_kwargs == {"enable_thinking": False}


def test_a_template_kwarg_the_chat_template_never_reads_is_refused(models):
    """Issue 46: a misspelt key (`enable_thinkin`) was accepted and changed nothing."""
    template = "{% if enable_thinking is defined and not enable_thinking %}NO-THINK {% endif %}{{ messages[-1] }}"
    (models / "out/zoo/a/chat_template.jinja").write_text(template)
    raw = cohort()
    raw["members"][0]["chat_template_kwargs"] = {"enable_thinkin": False}
    assert one_problem(raw) == (
        "members[0].chat_template_kwargs.enable_thinkin: the chat template of out/zoo/a never reads "
        "'enable_thinkin', so it changes nothing (the template reads: enable_thinking, messages); fix the spelling "
        "or remove it"
    )
    raw["members"][0]["chat_template_kwargs"] = {"enable_thinking": False}
    assert config_from_dict(raw).members[0].chat_template_kwargs == {"enable_thinking": False}
    raw["members"][1]["chat_template_kwargs"] = {"anything": 1}  # b has no template to read: nothing to say
    assert config_from_dict(raw).members[1].chat_template_kwargs == {"anything": 1}
    (models / "out/zoo/a/tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use",
                                                                         "template": "{{ tools }}"}]}))  # fmt: skip
    raw["members"][0]["chat_template_kwargs"] = {"tools": []}  # a named template's variable counts
    assert config_from_dict(raw).members[0].chat_template_kwargs == {"tools": []}


def test_unknown_keys_suggest_the_closest_valid_one(models):
    assert one_problem(cohort(rollout={"temprature": 0.5})) == (
        "unknown key 'rollout.temprature': did you mean 'temperature'?"
    )
    assert "did you mean 'members'?" in one_problem({"member": cohort()["members"], **cohort()})
    # A right name in the wrong section points to where it lives.
    assert one_problem(cohort(rollout={"lr": 1})) == (
        "unknown key 'rollout.lr': did you mean 'train.lr' or 'members[].lr'?"
    )
    assert "valid keys: report_to, samples_every, samples_per_step, progress, log_every" in one_problem(
        cohort(logging={"zzz": 1})
    )
    raw = cohort()
    raw["members"][0]["veiw"] = "original"
    assert one_problem(raw) == "unknown key 'members[0].veiw': did you mean 'view'?"


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"rollout": {"n": "4"}}, "rollout.n: expected an integer, got string '4' (write the number without quotes)"),
        ({"rollout": {"n": True}}, "rollout.n: expected an integer, got boolean true"),
        ({"rollout": {"n": 4.5}}, "rollout.n: expected an integer, got number 4.5"),
        ({"rollout": {"temperature": "hot"}}, "rollout.temperature: expected a number, got string 'hot'"),
        ({"rollout": {"stop": "</s>"}}, "rollout.stop: expected a list of strings, got string '</s>'"),
        ({"rollout": {"stop": ["a", 3]}}, "rollout.stop[1]: expected a string, got integer 3"),
        ({"logging": {"progress": "yes"}}, "logging.progress: expected true or false, got string 'yes'"),
        ({"data": {"train": {"options": [1]}}}, "data.train.options: expected a mapping with string keys, got list"),
        ({"data": {"train": {"limit": "all"}}}, "data.train.limit: expected an integer, got string 'all'"),
        ({"rollout": 5}, "rollout: expected a mapping of RolloutConfig fields, got integer"),
    ],
)
def test_wrong_types_name_the_field_and_the_expected_type(models, section, expected):
    assert one_problem(cohort(**section)) == expected


def test_empty_section_means_defaults(models):
    assert config_from_dict(cohort(rollout=None)).rollout.n == 4


@pytest.mark.parametrize(
    "raw_update, expected",
    [
        ({"reward": {"mode": "rign"}}, "reward.mode: 'rign' is not valid; choose one of: ring, peers, soft, peers_ema"),
        ({"algo": {"kl_estimator": "k2"}}, "algo.kl_estimator: 'k2' is not valid; choose one of: k1, k3"),
        ({"train": {"resume": "maybe"}}, "train.resume: expected true or false or auto, got string 'maybe'"),
        ({"train": {"mixed_precision": "bf32"}}, "choose one of: auto, no, bf16"),
        ({"rollout": {"engine": "sglang"}}, "rollout.engine: 'sglang' is not valid; choose one of: hf, vllm"),
        ({"data": {"view_fallback": "skip"}}, "choose one of: error, original"),
    ],
)
def test_invalid_choices_list_the_valid_ones(models, raw_update, expected):
    assert expected in one_problem(cohort(**raw_update))


def test_choice_suggests_the_closest_and_resume_accepts_bool_or_auto(models):
    assert "(did you mean 'ring'?)" in one_problem(cohort(reward={"mode": "rign"}))
    for value in (True, False, "auto"):
        assert config_from_dict(cohort(train={"resume": value})).train.resume == value


def test_member_choices(models):
    raw = cohort()
    raw["members"][0].update(dtype="fp8", prompt_style="latex")
    found = problems(raw)
    assert "members[0].dtype: 'fp8' is not valid; choose one of: auto, float32, bfloat16, float16" in found
    assert "members[0].prompt_style: 'latex' is not valid; choose one of: boxed, answer_tags" in found


def test_missing_required_fields(models):
    assert one_problem({}) == "members: missing (required): the cohort members"
    assert one_problem({"members": []}).startswith("members: needs at least 1 item(s), got 0")
    raw = cohort()
    del raw["members"][0]["model"], raw["members"][1]["id"]
    assert sorted(problems(raw)) == [
        "members[0].model: missing (required): local Hugging Face model directory with a config.json"
        " (a relative path: beside the cohort file where it exists there, else from the working directory)",
        "members[1].id: missing (required): unique member name, used in logs and as its checkpoint directory name",
    ]


@pytest.mark.parametrize("view", ["paraphrase:0", "paraphrase", "paraphrase:x", "Original", "paraphrase:-1"])
def test_view_syntax(models, view):
    raw = cohort()
    raw["members"][1]["view"] = view
    assert one_problem(raw) == (
        f"members[1].view: {view!r} is not valid; expected original or paraphrase:K with K >= 1, e.g. paraphrase:1"
    )


def test_valid_views_and_ids(models):
    raw = cohort()
    raw["members"][0].update(view="paraphrase:12", id="Qwen2.5-VL_3b")
    assert config_from_dict(raw).members[0].view == "paraphrase:12"
    for bad in ("a b", "..", "a/b", ""):
        raw["members"][0]["id"] = bad
        assert one_problem(raw).startswith(f"members[0].id: {bad!r} is not valid; expected letters, digits")


@pytest.mark.parametrize(
    "raw_update, expected",
    [
        ({"rollout": {"n": 1}}, "rollout.n: must be >= 2, got 1 (a group needs at least 2 samples for an advantage)"),
        ({"rollout": {"temperature": 0}}, "rollout.temperature: must be > 0, got 0.0"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p: must be <= 1, got 1.5"),
        ({"reward": {"vote_threshold": 1.5}}, "reward.vote_threshold: must be <= 1, got 1.5"),
        ({"reward": {"vote_threshold": -0.1}}, "reward.vote_threshold: must be >= 0, got -0.1"),
        ({"reward": {"teacher_decay_start": 1.0}}, "reward.teacher_decay_start: must be < 1, got 1.0"),
        ({"reward": {"teacher_decay_end": 0}}, "reward.teacher_decay_end: must be > 0, got 0.0"),
        ({"algo": {"clip_low": -0.1}}, "algo.clip_low: must be >= 0, got -0.1"),
        ({"algo": {"clip_low": 1.0}}, "algo.clip_low: must be < 1, got 1.0 (1 - clip_low must stay positive)"),
        ({"algo": {"clip_high": -1}}, "algo.clip_high: must be >= 0, got -1.0"),
        ({"train": {"lr": 0}}, "train.lr: must be > 0, got 0.0"),
        ({"data": {"batch_size": 0}}, "data.batch_size: must be >= 1, got 0"),
        ({"train": {"keep_last": 0}}, "train.keep_last: must be >= 1, got 0"),
        ({"rollout": {"vllm": {"gpu_memory_utilization": 0}}}, "rollout.vllm.gpu_memory_utilization: must be > 0"),
    ],
)
def test_numeric_ranges(models, raw_update, expected):
    assert one_problem(cohort(**raw_update)).startswith(expected)


def test_member_lr_range(models):
    raw = cohort()
    raw["members"][1]["lr"] = -1e-6
    assert one_problem(raw) == "members[1].lr: must be > 0, got -1e-06"


def test_custom_reward_must_be_module_function(models):
    assert one_problem(cohort(reward={"custom": "my_rewards.score"})) == (
        "reward.custom: 'my_rewards.score' is not valid; expected module:function, e.g. my_pkg.rewards:score"
    )
    assert config_from_dict(cohort(reward={"custom": "my_pkg.rewards:score"})).reward.custom == "my_pkg.rewards:score"


# ----------------------------------------------------------------------------------------------- cross-field rules


def test_missing_model_path_says_how_to_get_one(models):
    raw = cohort()
    raw["members"][1]["model"] = "out/zoo/nope"
    message = one_problem(raw)
    assert message.startswith("members[1].model: 'out/zoo/nope' does not exist; it must be a local model directory")
    assert "corl zoo --out DIR" in message
    assert "huggingface-cli download ORG/NAME --local-dir DIR" in message
    raw["members"][1]["model"] = "out/zoo"  # a directory, but not a model
    assert "'out/zoo' has no config.json" in one_problem(raw)


def test_duplicate_member_ids(models):
    raw = cohort(3)
    raw["members"][2]["id"] = "a"
    assert one_problem(raw) == "members[2].id: duplicate id 'a' (also members[0].id); give every member a unique id"


@pytest.mark.parametrize("mode", ["ring", "peers", "soft"])
def test_peer_rewards_need_two_members(models, mode):
    message = one_problem(cohort(1, reward={"mode": mode}))
    assert message.startswith(f"reward.mode: {mode!r} rewards each member with its peers' answers and needs at least 2")


def test_peers_with_two_members_runs_with_a_warning(models, tmp_path, capsys):
    from vlm_corl.config.__main__ import main as config_main
    from vlm_corl.config.loading import config_warnings

    two = config_from_dict(cohort(2, reward={"mode": "peers"}))
    assert len(config_warnings(two)) == 1 and "equals ring" in config_warnings(two)[0]
    assert config_warnings(config_from_dict(cohort(3, reward={"mode": "peers"}))) == []
    path = tmp_path / "two.yaml"  # issue 46: `corl config` said nothing where train warns
    path.write_text(yaml.safe_dump(cohort(2, reward={"mode": "peers"})))
    assert config_main([str(path)]) == 0
    assert "warning: reward.mode peers with 2 members equals ring" in capsys.readouterr().err
    assert config_from_dict(cohort(3, reward={"mode": "peers"})).reward.mode == "peers"
    assert config_from_dict(cohort(2, reward={"mode": "soft"})).reward.mode == "soft"


@pytest.mark.parametrize("mode", ["gt", "self_vote", "self_certainty", "entropy", "co_rewarding_1", "co_rewarding_2"])
def test_single_model_baselines_work_with_any_n(models, mode):
    """Each member runs the baseline on its own (co_rewarding: its own two views / its own EMA teacher)."""
    for n in (1, 2, 3):
        assert len(config_from_dict(cohort(n, reward={"mode": mode})).members) == n


def test_reward_functions_add_to_the_mode_and_mode_none_is_theirs_alone(models):
    """reward.custom's functions are added to the mode's reward, so the mode's own checks still hold; with
    mode none (only the functions) one member is a cohort."""
    assert config_from_dict(cohort(1, reward={"mode": "none", "custom": "m:f"})).reward.custom == "m:f"
    assert "needs at least 2 members" in one_problem(cohort(1, reward={"mode": "ring", "custom": "m:f"}))
    listed = config_from_dict(cohort(2, reward={"custom": ["m:f", "m:g"], "weights": [1.0, 0.5]})).reward
    assert listed.custom == ["m:f", "m:g"] and listed.weights == [1.0, 0.5]
    assert one_problem(cohort(2, reward={"custom": ["m:f", "m:g"], "weights": [1.0]})) == (
        "reward.weights: 1 weight(s) for 2 reward.custom function(s); give one each"
    )
    assert one_problem(cohort(2, reward={"custom": ["m:f", "m.g"]})) == (
        "reward.custom[1]: 'm.g' is not valid; expected module:function, e.g. my_pkg.rewards:score"
    )


def test_frozen_peers_and_all_frozen(models):
    raw = cohort()
    raw["members"][1]["trainable"] = False
    assert config_from_dict(raw).members[1].trainable is False
    raw["members"][0]["trainable"] = False
    assert one_problem(raw).startswith("members: every member has trainable: false, so nothing would train")


def test_eval_every_needs_benchmarks(models):
    assert one_problem(cohort(eval={"every": 10})) == (
        "eval.benchmarks: eval.every=10 but no benchmark is listed; add names or set eval.every=0"
    )


def test_keep_best_names_an_evaluated_benchmark(models):
    assert one_problem(cohort(eval={"benchmarks": ["easyvqa"], "every": 10, "keep_best": "math500"})).startswith(
        "eval.keep_best: 'math500' ranks the in-loop evaluations, so it must be one of eval.benchmarks (easyvqa)"
    )
    assert one_problem(cohort(eval={"benchmarks": ["easyvqa"], "keep_best": "easyvqa"})).endswith("with eval.every > 0")
    ok = config_from_dict(cohort(eval={"benchmarks": ["easyvqa"], "every": 5, "keep_best": "easyvqa"}))
    assert ok.eval.keep_best == "easyvqa" and ok.train.on_collapse == "warn"
    assert one_problem(cohort(train={"on_collapse": "halt"})).startswith("train.on_collapse:")


def test_referenced_files_must_exist(models):
    found = problems(cohort(data={"paraphrases": "p.jsonl"}))
    assert found == ["data.paraphrases: file 'p.jsonl' does not exist; fix the path or set it to null"]
    Path("p.jsonl").write_text("")
    assert config_from_dict(cohort(data={"paraphrases": "p.jsonl"})).data.paraphrases == "p.jsonl"


def test_answer_style_must_read_the_prompted_style(models):
    raw = cohort(reward={"answer_style": "boxed"})
    raw["members"][1]["prompt_style"] = "answer_tags"
    assert one_problem(raw).startswith("reward.answer_style: 'boxed' cannot read members[1] answers")


def test_all_problems_are_reported_together_without_repeats(models):
    raw = cohort(1, rollout={"n": 1, "temprature": 1}, reward={"mode": "rign"}, train={"lr": -1})
    raw["members"][0].update(view="para", model="missing/dir")
    found = problems(raw)
    assert len(found) == 6, found
    fields = [p.split(":")[0] for p in found]
    assert fields == [
        "members[0].view",
        "unknown key 'rollout.temprature'",
        "rollout.n",
        "reward.mode",
        "train.lr",
        "members[0].model",
    ]
    # The invalid mode is not also reported as "ring needs 2 members": one problem per mistake.
    assert sum("reward.mode" in p for p in found) == 1


def test_validate_checks_a_config_built_in_code(models):
    cfg = CohortConfig(members=[MemberConfig(id="a", model="out/zoo/a"), MemberConfig(id="a", model="out/zoo/b")])
    with pytest.raises(ConfigError, match=r"members\[1\].id: duplicate id 'a'"):
        validate(cfg)


def test_check_registered_defers_to_the_registries(models):
    loader = LOADERS.register("test_config_fake_loader")(lambda **kw: [])
    cfg = config_from_dict(cohort(data={"train": {"loader": "test_config_fake_loader"}}))
    check_registered(cfg)
    cfg.data.train.loader = "test_config_fake_loadr"
    with pytest.raises(ConfigError, match="data.train.loader: unknown loaders 'test_config_fake_loadr'. Did you mean"):
        check_registered(cfg)
    cfg.data.train.loader = "json:no_such_function"
    cfg.members[0].family = "no_such_family"
    with pytest.raises(ConfigError) as info:
        check_registered(cfg)
    assert [p.split(":")[0] for p in info.value.problems] == ["data.train.loader", "members[0].family"]
    cfg.data.train.loader, cfg.members[0].family = "test_config_fake_loader", None
    cfg.reward.mode, cfg.eval.benchmarks = "rin", ["easyvqa", "no_such_bench"]
    with pytest.raises(ConfigError) as info:
        check_registered(cfg)
    assert [p.split(":")[0] for p in info.value.problems] == ["reward.mode", "eval.benchmarks"]
    assert "Did you mean 'ring'" in info.value.problems[0]
    assert loader is LOADERS.get("test_config_fake_loader")


# ----------------------------------------------------------------------------------------------- overrides


def test_overrides_nested_list_index_and_yaml_values(models):
    Path("c.yaml").write_text(yaml.safe_dump(cohort(3)))
    cfg = load_config(
        "c.yaml",
        [
            "rollout.n=8",
            "rollout.vllm.gpu_memory_utilization=0.8",
            "members.1.view=paraphrase:1",
            "members[2].trainable=false",
            "rollout.stop=[a, b]",
            "eval.benchmarks=[mathvista,we_math]",
            "data.train.limit=null",
            "data.train.options.sub.key=3",
            "reward.mode=peers",
            "name=run=1",  # only the first '=' splits
        ],
    )
    assert cfg.rollout.n == 8 and cfg.rollout.vllm.gpu_memory_utilization == 0.8
    assert cfg.members[1].view == "paraphrase:1" and cfg.members[2].trainable is False
    assert cfg.rollout.stop == ["a", "b"] and cfg.eval.benchmarks == ["mathvista", "we_math"]
    assert cfg.data.train.limit is None and cfg.data.train.options == {"sub": {"key": 3}}
    assert cfg.reward.mode == "peers" and cfg.name == "run=1"


def test_override_values_are_validated_like_the_file(models):
    assert one_problem(cohort(), ["rollout.n=1"]).startswith("rollout.n: must be >= 2, got 1")
    message = one_problem(cohort(), ["members.0.view=paraphrase:0"])
    assert message.startswith("members[0].view: 'paraphrase:0' is not valid")


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "rollout.temprature=0.5",
            "override 'rollout.temprature=0.5': unknown key 'rollout.temprature': did you mean 'temperature'?",
        ),
        ("rollout.vllm.enforce_eagr=true", "unknown key 'rollout.vllm.enforce_eagr': did you mean 'enforce_eager'?"),
        ("members.0.veiw=original", "unknown key 'members[0].veiw': did you mean 'view'?"),
        ("members.5.view=original", "override 'members.5.view=original': '5' is not an index of members (2 item(s))"),
        ("members.x.view=original", "'x' is not an index of members (2 item(s))"),
        ("eval.benchmarks.0=x", "'0' is not an index of eval.benchmarks (0 item(s))"),
        ("rollout.n.k=1", "override 'rollout.n.k=1': rollout.n is an integer, it has no key 'k'"),
        ("reward.mode.x=1", "override 'reward.mode.x=1': reward.mode is ring or peers or soft"),
        ("rollout.n", "override 'rollout.n': expected dotted.key=value, e.g. rollout.n=8"),
        ("rollout.n=[1", "override 'rollout.n=[1':1:3: invalid YAML:"),
    ],
)
def test_bad_overrides(models, override, expected):
    assert expected in one_problem(cohort(), [override])


# ----------------------------------------------------------------------------------------------- files


def test_file_errors(models):
    assert one_problem(path=Path("nope.yaml")).startswith("nope.yaml: cannot read the config file (No such file")
    Path("bad.yaml").write_text("members:\n  - id: a\n    model: [x\n")
    assert one_problem(path=Path("bad.yaml")).startswith("bad.yaml:4:1: invalid YAML:")
    Path("list.yaml").write_text("- a\n- b\n")
    assert one_problem(path=Path("list.yaml")) == (
        "list.yaml: the top level must be a mapping of sections (members, data, ...), got a list"
    )
    Path("dup.yaml").write_text("members: []\nrollout: {n: 4}\nrollout: {n: 8}\n")
    assert one_problem(path=Path("dup.yaml")) == "dup.yaml:3:1: invalid YAML: duplicate key 'rollout'"
    Path("empty.yaml").write_text("# nothing\n")
    assert one_problem(path=Path("empty.yaml")) == "members: missing (required): the cohort members"


def test_config_from_dict_rejects_a_non_mapping():
    assert one_problem([1, 2]) == "(top level): expected a mapping of CohortConfig fields, got list"


# ----------------------------------------------------------------------------------------------- CLI


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "vlm_corl.config", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_cli_prints_the_resolved_config(models):
    Path("good.yaml").write_text(yaml.safe_dump(cohort()))
    run = _cli("good.yaml", "rollout.n=8", cwd=models)
    assert run.returncode == 0, run.stderr
    printed = yaml.safe_load(run.stdout)
    assert printed == config_to_dict(load_config("good.yaml", ["rollout.n=8"]))
    assert printed["rollout"]["n"] == 8 and printed["algo"]["clip_low"] == 0.2


def test_cli_reports_problems_with_exit_2_and_no_traceback(models):
    Path("bad.yaml").write_text(yaml.safe_dump(cohort(rollout={"temprature": 0.5})))
    run = _cli("bad.yaml", "members.0.view=paraphrase:0", cwd=models)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines()[0] == "bad.yaml: invalid cohort config (2 problems):"
    assert "unknown key 'rollout.temprature': did you mean 'temperature'?" in run.stderr
    assert "members[0].view: 'paraphrase:0' is not valid" in run.stderr
    assert "Traceback" not in run.stderr
    missing = _cli("missing.yaml", cwd=models)
    assert missing.returncode == 2 and "cannot read the config file" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_cli_explain(models):
    run = _cli("--explain", cwd=models)
    assert run.returncode == 0 and "reward.mode: ring or peers or soft" in run.stdout

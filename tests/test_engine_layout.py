"""Layouts vLLM cannot run are refused before any model loads: Llama-3.2-Vision on vLLM, ranks that would build
different numbers of vLLM engines (vLLM's torchrun launcher meets every rank per engine built: a hang), and
sleep mode with several engines in one process (vLLM allows one). By `python -m vlm_corl.config` when the ranks
are known (members[i].ranks or --processes) and by `train` at start (exit 2)."""

from __future__ import annotations

import json

import pytest

from vlm_corl.config import ConfigError, config_from_dict
from vlm_corl.config.__main__ import main as config_main
from vlm_corl.config.engine_layout import engine_layout_problems, vllm_engines_by_rank


@pytest.fixture
def models(tmp_path):
    """Model directories with just the config.json the checks read: two Qwen2-VL, one Llama-3.2-Vision."""
    paths = {}
    for name, kind in (("qwen", "qwen2_vl"), ("intern", "internvl"), ("llama", "mllama")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": kind}))
        paths[name] = str(tmp_path / name)
    return paths


def raw(models, *members, **sections):
    """A cohort on vLLM with the given (id, model name, extra fields) members."""
    return {
        "members": [{"id": mid, "model": models[name], **extra} for mid, name, extra in members],
        "rollout": {"engine": "vllm", **sections.pop("rollout", {})},
        **sections,
    }


def test_llama_vision_on_vllm_is_refused_naming_the_member_and_accepted_on_hf(models):
    cfg = raw(models, ("q", "qwen", {}), ("l", "llama", {}))
    with pytest.raises(ConfigError) as info:
        config_from_dict(cfg)
    assert info.value.fields == ["members[1].engine"]
    assert "member 'l' is a Llama-3.2-Vision (mllama) model" in info.value.problems[0]
    assert "members[1].engine: hf" in info.value.problems[0]
    cfg["members"][1]["engine"] = "hf"
    assert config_from_dict(cfg).members[1].engine == "hf"


def test_the_config_command_exits_2_for_llama_vision_on_vllm(models, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(raw(models, ("q", "qwen", {}), ("l", "llama", {}))))
    assert config_main([str(path)]) == 2
    assert "members[1].engine" in capsys.readouterr().err
    assert config_main([str(path), "members.1.engine=hf"]) == 0


def test_unequal_vllm_engine_counts_across_ranks_are_refused(models):
    """Qwen on vLLM over ranks 0-1, Llama-Vision on HF over 2-3: ranks 0-1 build an engine, 2-3 none."""
    cfg = raw(
        models,
        ("q", "qwen", {"ranks": [0, 1]}),
        ("l", "llama", {"ranks": [2, 3], "engine": "hf"}),
    )
    with pytest.raises(ConfigError) as info:
        config_from_dict(cfg)
    (problem,) = info.value.problems
    assert "same number of vLLM engines" in problem and "rank 0: q" in problem and "rank 2: none" in problem
    # The fix the message names: the HF member beside a vLLM member on the same ranks.
    cfg["members"].append({"id": "i", "model": models["intern"], "ranks": [2, 3]})
    assert len(config_from_dict(cfg).members) == 3


def test_sleep_mode_with_two_engines_in_one_process_is_refused(models):
    cfg = raw(models, ("q", "qwen", {"ranks": [0]}), ("i", "intern", {"ranks": [0]}))
    cfg["rollout"]["vllm"] = {"enable_sleep_mode": True}
    with pytest.raises(ConfigError, match=r"rollout.vllm.enable_sleep_mode: .*rank 0 builds 2 \(q, i\)"):
        config_from_dict(cfg)
    cfg["members"][1]["engine"] = "hf"  # one vLLM engine per process: fine
    config_from_dict(cfg)


def test_the_layout_is_checked_for_a_given_launch_size(models, tmp_path, capsys):
    """Without members[i].ranks the layout depends on the launch: --processes checks it."""
    path = tmp_path / "c.yaml"
    cfg = raw(models, ("q", "qwen", {}), ("i", "intern", {}), rollout={"vllm": {"enable_sleep_mode": True}})
    path.write_text(json.dumps(cfg))
    assert config_main([str(path)]) == 0  # unknown launch: checked by train at start
    assert config_main([str(path), "--processes", "2"]) == 0  # one member per process
    assert config_main([str(path), "--processes", "1"]) == 2  # both in one process, asleep
    assert "one engine per process" in capsys.readouterr().err


def test_engines_are_counted_in_build_order_with_teachers(models):
    cfg = config_from_dict(raw(models, ("q", "qwen", {}), ("i", "intern", {"engine": "hf"})))
    built = vllm_engines_by_rank(cfg, {"q": (0, 1), "i": (0, 1)}, teachers=True)
    assert built == {0: ["q", "q.teacher"], 1: ["q", "q.teacher"]}
    assert engine_layout_problems(cfg, {"q": (0, 1), "i": (0, 1)}, teachers=True) == []


def test_train_refuses_the_layout_of_its_launch_before_loading_a_model(tiny_zoo, tmp_path):
    """`python -m vlm_corl.train` is a launch of 1: both vLLM members would sleep in one process."""
    from cohort_helpers import cohort

    from vlm_corl.training.loop import run_cohort

    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["internvl"])])
    cfg["rollout"].update(engine="vllm", vllm={"enable_sleep_mode": True})
    with pytest.raises(ConfigError, match="one engine per process"):
        run_cohort(config_from_dict(cfg))
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped before the run directory was touched

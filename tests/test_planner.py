"""The cohort memory planner (vlm_corl.planning, `python -m vlm_corl.plan`): its estimates worked by hand, model
shapes of the released architectures, per-rank plans by phase, the fixes and `--suggest` on real-size cohorts,
`train`'s check before any model loads, the docs' figures regenerated from it, and bench/plan_check.py (a real
run's states against the plan) at its smallest size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from cohort_helpers import ROOT, cohort, python_m

from vlm_corl.commands.plan import main as plan_main
from vlm_corl.commands.plan import released_config
from vlm_corl.config import ConfigError, config_from_dict, load_config, read_raw_config
from vlm_corl.errors import UserError
from vlm_corl.members.memory import GB, memory_size
from vlm_corl.planning import estimates as est
from vlm_corl.planning.check import against_plan, check_launch
from vlm_corl.planning.cohort import Hardware, plan_cohort, with_changes
from vlm_corl.planning.fixes import fixes
from vlm_corl.planning.shapes import model_shape
from vlm_corl.planning.suggest import compositions, suggest

MODELS = ROOT / "configs" / "models"
COHORTS = ROOT / "configs" / "cohorts"


def real_cohort(**sections) -> dict:
    """A cohort of released architectures (no weights: the planner reads config.json only)."""
    return {
        "members": [
            {"id": "qwen", "model": str(MODELS / "qwen2.5-vl-3b-instruct")},
            {"id": "intern", "model": str(MODELS / "internvl3-2b-hf")},
        ],
        **sections,
    }


# --- the estimates, worked by hand ---
def test_activation_formula_worked_by_hand():
    # c (4h + 2kv + 4I) + 8h with h=4, I=8, kv=2, c=2: 2 * (16 + 4 + 32) + 32 = 136 bytes per token and layer
    assert est.layer_bytes_per_token(4, 8, 2, 2) == 136
    shape = model_shape(str(MODELS / "qwen2.5-vl-3b-instruct"))
    h, layers, inter, kv = shape.hidden, shape.layers, shape.intermediate, shape.kv_heads * shape.head_dim
    per_token = 2 * (4 * h + 2 * kv + 4 * inter) + 8 * h
    full = est.activation_bytes(shape, tokens=1000, patches=0, compute_bytes=2, checkpointing=False)
    assert full == {"text": layers * per_token * 1000}
    # checkpointing keeps each layer's fp32 input and recomputes one layer: far less than every layer's tensors
    ckpt = est.activation_bytes(shape, tokens=1000, patches=0, compute_bytes=2, checkpointing=True)
    assert ckpt == {"text": layers * 4 * h * 1000 + per_token * 1000}
    vision = est.activation_bytes(shape, tokens=10, patches=100, compute_bytes=4, checkpointing=False)["vision"]
    v, vi = shape.vision_hidden, shape.vision_intermediate
    assert vision == shape.vision_layers * (4 * (4 * v + 2 * v + 4 * vi) + 8 * v) * 100
    # KV cache: 2 (k, v) x layers x kv heads x head dim x bytes; 36 layers x 2 heads x 128 x 2 bytes x 2 = 36,864
    assert est.kv_bytes_per_token(shape, 2) == 36_864
    assert est.logits_bytes(2, 100, 1000, 2) == 1.5 * 2 * 100 * 1000 * 2 + est.CHUNK_BYTES


def test_deepspeed_buffers_by_stage():
    shape = model_shape(str(MODELS / "qwen2.5-vl-3b-instruct"))
    assert est.deepspeed_buffers({}, shape) == {}
    zero2 = est.deepspeed_buffers({"stage": 2, "reduce_bucket_size": 50_000_000}, shape)
    assert zero2 == {"ds_reduce_bucket": 200e6}
    assert est.deepspeed_buffers({"stage": 2, "reduce_bucket_size": 10, "overlap_comm": True}, shape) == {
        "ds_reduce_bucket": 80.0
    }
    zero3 = est.deepspeed_buffers({"stage": 3, "reduce_bucket_size": 50_000_000}, shape)
    assert zero3["ds_buckets"] == 200e6  # allocated whatever the model's size (bench/plan_check.py measured it)
    assert zero3["ds_gathered"] == (est.DS_DEFAULT_PREFETCH + shape.largest_tensor) * 4


def test_shapes_of_released_architectures():
    qwen = model_shape(str(MODELS / "qwen2.5-vl-3b-instruct"))
    assert (qwen.hidden, qwen.layers, qwen.kv_heads, qwen.head_dim, qwen.vocab) == (2048, 36, 2, 128, 151936)
    assert qwen.checkpoint_bytes == 2 and qwen.is_vision
    assert qwen.patches_per_image(1280 * 28 * 28) == 5120  # 14-px patches at the trainer's cap
    assert model_shape(str(MODELS / "internvl3-2b-hf")).fixed_patches == 13 * 32 * 32  # 12 tiles + thumbnail
    assert model_shape(str(MODELS / "gemma-3-4b-it")).fixed_patches == 64 * 64
    assert model_shape(str(MODELS / "llama-3.2-11b-vision-instruct")).fixed_patches == 4 * (40 * 40 + 1)
    text = model_shape(str(MODELS / "qwen3-8b"))
    assert not text.is_vision and text.patches_per_image(10**6) == 0 and text.head_dim == 128


# --- plans ---
def test_a_rank_plan_counts_states_and_the_larger_phase():
    cfg = config_from_dict(real_cohort(data={"batch_size": 16}, train={"micro_batch_size": 1}))
    plan = plan_cohort(cfg, Hardware(2, 80 * GB))
    rank = plan.ranks[0]  # automatic split: qwen on rank 0, intern on rank 1
    assert rank.members == ["qwen"] and plan.placement == {"qwen": (0,), "intern": (1,)}
    parts = {(it.part, it.phase): it.bytes for it in rank.items}
    p = model_shape(str(MODELS / "qwen2.5-vl-3b-instruct")).params
    assert parts[("weights", "resident")] == 4 * p and parts[("optimizer", "resident")] == 8 * p
    assert parts[("autocast_weights", "update")] == 2 * p  # the update's bf16 casts
    assert parts[("rollout_copy", "resident")] == 2 * p and ("autocast_weights", "rollout") not in parts  # issue 55
    assert rank.peak == rank.phase_bytes("resident") + max(rank.phase_bytes("rollout"), rank.phase_bytes("update"))
    assert rank.states_bytes() == 18 * p
    # ZeRO-2: gradients only during the update; vLLM with sleep mode: the engine's share only during rollouts
    zero2 = with_changes(
        cfg,
        {
            "train.deepspeed": str(ROOT / "configs/deepspeed/zero2.json"),
            "rollout.engine": "vllm",
            "rollout.vllm.enable_sleep_mode": True,
        },
    )
    phases = {it.part: it.phase for it in plan_cohort(zero2, Hardware(2, 80 * GB)).ranks[0].items}
    assert phases["gradients"] == "update" and phases["ds_reduce_bucket"] == "update"
    assert phases["vllm_weights"] == phases["vllm_kv_cache"] == "rollout"
    awake = with_changes(zero2, {"rollout.vllm.enable_sleep_mode": False})
    assert {it.part: it.phase for it in plan_cohort(awake, Hardware(2, 80 * GB)).ranks[0].items}["vllm_kv_cache"] == (
        "resident"
    )
    # a member hosted beside another (shared ranks) adds its states; the phases cost the larger member's
    shared = with_changes(cfg, {"members.0.ranks": [0, 1], "members.1.ranks": [0, 1]})
    both = plan_cohort(shared, Hardware(2, 80 * GB)).ranks[0]
    assert both.members == ["qwen", "intern"]
    per_member = {
        m: sum(it.bytes for it in both.items if it.member == m and it.phase == "update") for m in both.members
    }
    assert both.phase_bytes("update") == max(per_member.values())


def test_a_vllm_share_too_small_for_one_sequence_is_a_problem():
    cfg = config_from_dict(real_cohort(rollout={"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.05}}))
    plan = plan_cohort(cfg, Hardware(2, 80 * GB))
    assert not plan.fits and "one sequence of max_model_len" in plan.ranks[0].problems[0]


def test_an_11b_member_on_one_card_does_not_fit_and_zero3_over_more_ranks_does():
    cfg = config_from_dict(
        {
            "members": [{"id": "llama", "model": str(MODELS / "llama-3.2-11b-vision-instruct")}],
            "reward": {"mode": "self_vote"},
            "data": {"batch_size": 16},
        }  # fmt: skip
    )
    plan = plan_cohort(cfg, Hardware(1, 80 * GB))
    assert not plan.fits and plan.worst.peak > 170 * GB  # 16 bytes per parameter alone
    found = fixes(cfg, plan)
    wider = [f for f in found if f["change"].startswith("ZeRO-3 over")]
    assert wider and wider[0]["fits"] and found[0] is wider[0], found  # the one that fits comes first
    processes = int(wider[0]["launch"].split()[0])
    changes = dict(o.split("=", 1) for o in wider[0]["overrides"])
    after = load_config_with(cfg, wider[0]["overrides"], processes)
    assert changes["train.deepspeed"].endswith("zero3.json") and plan_cohort(after, Hardware(processes, 80 * GB)).fits
    assert all(f["saves_gb"] > 0 for f in found)


def load_config_with(cfg, overrides: list[str], processes: int):
    """`cfg` with dotted overrides, through the real config loader (a file written from it)."""
    from dataclasses import asdict

    raw = asdict(cfg)
    from vlm_corl.config.parse import Problems, apply_override

    problems = Problems()
    for o in overrides:
        apply_override(raw, o, problems)
    assert not problems.items, problems.items
    return config_from_dict(raw, processes)


def test_compositions_split_the_ranks_and_overrides_read_back():
    from vlm_corl.planning.fixes import yaml_value

    assert list(compositions(4, 2)) == [[1, 3], [2, 2], [3, 1]]
    assert [yaml_value(v) for v in (None, True, [0, 1], 2, "configs/deepspeed/zero3.json")] == [
        "null", "true", "[0,1]", "2", "configs/deepspeed/zero3.json"
    ]  # fmt: skip
    assert len(list(compositions(8, 3))) == 21


# --- the command ---
def recipe_overrides(path: Path) -> list[str]:
    members = read_raw_config(path)["members"]
    return [f"members.{i}.model={MODELS / Path(m['model']).name}" for i, m in enumerate(members)]


DEMO_BASES = dict.fromkeys(("qwen2_vl", "qwen2_vl_b", "qwen2_vl_c", "qwen2_vl_d"), "qwen2_vl")  # `make demo`s bases


def zoo_family(model: str) -> str:
    """The zoo family a cohort file's model path stands for (out/zoo/<family>, or a demo base model)."""
    name = Path(model).name
    return DEMO_BASES[name] if "demo" in model else name


@pytest.mark.parametrize("name", sorted(p.name for p in COHORTS.glob("*.yaml")))
def test_plan_runs_on_every_cohort_file(name, tiny_zoo, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = COHORTS / name
    if name.startswith("gpu_"):
        overrides, hardware = recipe_overrides(path), ["--gpus-per-node", "8" if "1node" in name else "1"]
    else:  # the demo and examples point at models `make demo` / the zoo build: the tiny zoo stands in
        members = read_raw_config(path)["members"]
        overrides = [f"members.{i}.model={tiny_zoo[zoo_family(m['model'])]}" for i, m in enumerate(members)]
        hardware = ["--gpus-per-node", "1", "--gpu-memory", "24GiB"]
    assert plan_main(["--config", str(path), *overrides, *hardware]) == 0
    text = capsys.readouterr().out
    assert "memory plan of" in text and ("\nfits:" in text or "\ndoes not fit:" in text)
    assert plan_main(["--config", str(path), *overrides, *hardware, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["ranks"] and all("peak_gb" in r for r in plan["ranks"])


def test_suggest_for_three_real_members_on_one_node_is_a_layout_the_planner_accepts(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    recipe = COHORTS / "gpu_1node_3vlm.yaml"
    # Made not to fit: no gradient checkpointing, micro-batches of 8, no ZeRO.
    broken = [*recipe_overrides(recipe), "train.gradient_checkpointing=false", "train.micro_batch_size=8",
              "train.deepspeed=null"]  # fmt: skip
    assert plan_main(["--config", str(recipe), *broken, "--suggest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["fixes"]
    suggestion = out["suggestion"]
    assert suggestion and suggestion["plan"]["fits"] and suggestion["yaml"]
    cfg = load_config(recipe, [*broken, *suggestion["overrides"]], processes=8)
    assert plan_cohort(cfg, Hardware(8, 80 * GB)).fits
    assert plan_main(["--config", str(recipe), *broken, "--suggest"]) == 0
    text = capsys.readouterr().out
    assert "cheapest layout that fits" in text and "# as overrides:" in text


def test_suggest_places_members_a_launch_cannot_split_evenly(tmp_path, capsys):
    three = real_cohort(data={"batch_size": 48}, reward={"mode": "peers"})
    three["members"].append({"id": "gemma", "model": str(MODELS / "gemma-3-4b-it")})
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(three))
    with pytest.raises(UserError, match="cannot be split evenly over 8 processes.*--suggest"):
        plan_main(["--config", str(path)])
    assert plan_main(["--config", str(path), "--suggest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # one JSON object, the problems in it (issue 46: a text line came first)
    assert any("cannot be split evenly" in p for p in out["problems"])
    suggestion = out["suggestion"]
    assert any(o.startswith("members.2.ranks=") for o in suggestion["overrides"])
    cfg = load_config(path, suggestion["overrides"], processes=8)
    assert plan_cohort(cfg, Hardware(8, 80 * GB)).fits
    assert {r for m in cfg.members for r in m.ranks} == set(range(8))  # every GPU of the node is used


def test_suggest_for_overlapping_ranks_prints_a_file_to_paste(tmp_path, capsys):
    """Issue 32: members on overlapping but different ranks, --suggest (text): a suggestion that moves one member
    and leaves another where its ranks are printed a KeyError instead of the lines to paste."""
    two = real_cohort()
    two["members"][0]["ranks"], two["members"][1]["ranks"] = [0, 1], [1]
    path = tmp_path / "overlap.yaml"
    path.write_text(yaml.safe_dump(two))
    assert plan_main(["--config", str(path), "--gpus-per-node", "2", "--suggest"]) == 0
    out = capsys.readouterr().out
    pasted = out[out.index("members:") :].splitlines()
    assert [line.strip() for line in pasted[1:5]][1::2] == ["ranks: [0, 1]", "ranks: [0, 1]"]


def test_suggest_says_when_nothing_fits():
    cfg = config_from_dict(real_cohort())
    assert suggest(cfg, Hardware(1, 8 * GB)) is None


def test_plan_command_answers_mistakes_with_exit_2(capsys):
    assert memory_size("80GB") == 80e9 and memory_size("141 GiB") == 141 * 2**30 and memory_size("80") == 80e9
    with pytest.raises(SystemExit) as stop:
        plan_main(["--config", str(COHORTS / "gpu_1gpu_2vlm.yaml"), "--gpu-memory", "lots"])
    assert stop.value.code == 2
    for negative in ("-80GB", "-1"):  # issue 46: argparse answered "expected one argument" for -80GB
        with pytest.raises(SystemExit):
            plan_main(["--config", str(COHORTS / "gpu_1gpu_2vlm.yaml"), "--gpu-memory", negative])
        assert f"expected a positive size such as 80GB or 141GiB, got '{negative}'" in capsys.readouterr().err
    # models/... not downloaded here: the released architectures of the same names stand in (said on stderr)
    assert plan_main(["--config", str(COHORTS / "gpu_1gpu_2vlm.yaml"), "--gpus-per-node", "1"]) == 0
    assert "members[0].model models/qwen2-vl-2b-instruct does not exist: planned with" in capsys.readouterr().err
    with pytest.raises(UserError, match="names no released architecture under .*configs/models.*add the model's"):
        plan_main(["--config", str(COHORTS / "gpu_1gpu_2vlm.yaml"), "members.0.model=models/mine"])
    result = python_m("vlm_corl.plan", "--config", COHORTS / "gpu_1node_3vlm.yaml", *recipe_overrides(
        COHORTS / "gpu_1node_3vlm.yaml"), "--gpus-per-node", "2")  # fmt: skip
    assert result.returncode == 2 and "cannot launch on 2 process(es)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_not_downloaded_is_found_by_its_directory_or_the_repository_models_json_records(tmp_path):
    models = tmp_path / "models"
    (models / "vlm-small").mkdir(parents=True)
    (models / "vlm-small" / "config.json").write_text("{}")
    (models / "models.json").write_text(json.dumps({"vlm-small": {"repo": "Org/VLM-Small-2B-Instruct"}}))
    assert released_config("downloads/VLM-SMALL", models) == (models / "vlm-small", "same directory name")
    by_repo = (models / "vlm-small", "models.json: Org/VLM-Small-2B-Instruct")
    assert released_config("Org/VLM-Small-2B-Instruct", models) == by_repo  # the hub id as the member's model
    assert released_config("models/vlm-small-2b-instruct", models) == by_repo  # a folder named after the repo
    assert released_config("models/vlm-small-7b", models) is None


def test_a_member_whose_architecture_transformers_does_not_know_is_refused_without_a_traceback(tmp_path):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_arch", "hidden_size": 64}))
    recipe = COHORTS / "gpu_1gpu_2vlm.yaml"
    with pytest.raises(UserError, match="no_such_arch' has no registered family .* generic family cannot load it"):
        plan_main(["--config", str(recipe), f"members.1.model={unknown}", "--gpus-per-node", "1"])


# --- train's check ---
def test_train_stops_a_layout_that_cannot_fit_before_loading_a_model(tiny_zoo, tmp_path):
    weightless = tmp_path / "weightless"  # the tokenizer, processor and config, no weights: loading would fail
    shutil.copytree(tiny_zoo["qwen2_vl"], weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = cohort(tmp_path, [("a", weightless), ("b", tiny_zoo["mllama"])])
    cfg["train"].update(check_memory="error", device_memory_gb=0.001)
    path = tmp_path / "cohort.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = python_m("vlm_corl.train", "--config", path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "memory plan: does not fit" in result.stderr and "train.check_memory" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_train_with_check_memory_warn_runs_and_writes_its_plan(tiny_zoo, tmp_path, caplog):
    from vlm_corl.training.loop import run_cohort

    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["mllama"])])
    cfg["train"].update(max_steps=1, check_memory="warn", device_memory_gb=0.001)
    with caplog.at_level("WARNING", logger="vlm_corl"):
        summary = run_cohort(config_from_dict(cfg))
    assert summary["run_dir"] == str(tmp_path / "run")
    assert any("memory plan: does not fit" in r.getMessage() for r in caplog.records)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["fits"] is False and plan["hardware"]["device_gb"] == 0.001 and plan["fixes"] is not None
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2  # both members trained the step


def test_check_memory_modes(tiny_zoo, tmp_path):
    import torch

    cfg = config_from_dict(cohort(tmp_path, [("a", tiny_zoo["qwen2_vl"])], reward={"mode": "entropy"}))
    cpu = torch.device("cpu")
    assert check_launch(cfg, cpu, 1, True).fits  # auto on a CPU: warn, and a tiny member fits the host
    tight = with_changes(cfg, {"train.device_memory_gb": 0.001})
    assert not check_launch(tight, cpu, 1, True).fits  # auto on a CPU warns: no error
    with pytest.raises(ConfigError, match="memory plan: does not fit"):
        check_launch(with_changes(tight, {"train.check_memory": "error"}), cpu, 1, True)
    assert check_launch(with_changes(tight, {"train.check_memory": "off"}), cpu, 1, True) is None


def test_metrics_rows_set_cuda_peaks_beside_the_plan():
    cfg = config_from_dict(real_cohort())
    plan = plan_cohort(cfg, Hardware(2, 80 * GB))
    fields = against_plan(plan, 1, {"rollout": 20.0, "update": 30.0})
    assert fields["plan_gb"] == pytest.approx(plan.ranks[1].peak / GB)
    assert fields["peak_over_plan"] == pytest.approx(30.0 / fields["plan_gb"])
    assert against_plan(plan, 1, {}) == {} and against_plan(None, 0, {"update": 1.0}) == {}  # off CUDA / off


RECIPE_HEADROOM_GB = 10  # what every rank of a shipped recipe keeps under the plan: the plan cannot see everything


@pytest.mark.parametrize("recipe", sorted(p.name for p in COHORTS.glob("gpu_*.yaml")))
def test_the_gpu_recipes_keep_their_headroom_under_the_whole_plan(recipe, monkeypatch):
    """vLLM's activations, graphs and launcher minimum, the optimizer step and Adam's moments at vLLM's start-up
    all counted: every rank keeps RECIPE_HEADROOM_GB, every vLLM slot holds a sequence, and the host and disk
    figures are there."""
    monkeypatch.chdir(ROOT)
    path = COHORTS / recipe
    processes = 8 if "1node" in recipe else 1
    plan = plan_cohort(load_config(path, recipe_overrides(path), processes=processes), Hardware(processes, 80 * GB))
    assert plan.fits, [r.problems for r in plan.ranks]
    assert min(r.usable - r.peak for r in plan.ranks) >= RECIPE_HEADROOM_GB * GB, plan.worst.to_dict()
    assert all(slot["holds_one_sequence"] for slot in plan.engine_slots)
    assert plan.host.nodes() and plan.disk.total > 0


# --- the figures the docs quote, and the measured check ---
def test_readme_table_and_recipe_blocks_are_the_planners():
    from vlm_corl.planning.tables import regenerate

    for path, text in regenerate().items():
        assert path.read_text() == text, f"{path} drifted: run python -m vlm_corl.planning.tables"


def test_plan_check_bench_measures_states_within_tolerance(tiny_zoo):
    zoo = Path(str(tiny_zoo["qwen2_vl"])).parent
    result = python_m("bench.plan_check", "--sizes", "tiny", "--updates", "dp,zero2", "--zoo", zoo)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["errors"] == [] and report["states_within_tolerance"], report
    rank = report["cases"]["tiny/dp"]["ranks"][0]
    assert rank["saved_for_backward_mb"] > 0 and rank["activation_estimate_mb"] > 0
    # ZeRO-2's optimizer step: its flat copy of the gradient partition, measured against the plan's
    steps = [s for r in report["cases"]["tiny/zero2"]["ranks"] for s in r["zero_step"].values()]
    assert len(steps) == 4 and report["zero_step_within_plan"], steps
    assert all(s["ratio"] == pytest.approx(1, abs=0.05) for s in steps), steps

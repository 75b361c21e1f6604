"""LoRA members (vlm_corl.members.lora, members[i].lora): only the adapters train and the base stays bit-identical;
the checkpoint is a PEFT adapter (megabytes, loadable with PeftModel.from_pretrained); the merged weights a LoRA
member serves are W + alpha/r B A under the base's names (what PEFT's merge gives); `export --merge` writes a model
`from_pretrained` loads, equal to the member; resume is bit-identical; ZeRO-2 and ZeRO-3 train it on a bf16 base
(slow: make test-scale); the planner counts the adapters; a frozen member with lora is a config error."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from cohort_helpers import ROOT, cohort, metrics, python_m, trained_fields, weights
from safetensors.torch import load_file

from vlm_corl import cli, export
from vlm_corl.config import config_from_dict
from vlm_corl.config.parse import ConfigError
from vlm_corl.config.schema import LoraConfig, MemberConfig
from vlm_corl.errors import UserError
from vlm_corl.members.lora import adapter_tensors, merged_weights, scalings, target_modules
from vlm_corl.members.member import load_member
from vlm_corl.members.state_files import named_tensors
from vlm_corl.training.loop import run_cohort

LORA = {"r": 4, "alpha": 8.0}


def _config(tmp: Path, base_models: dict, **train) -> dict:
    cfg = cohort(
        tmp,
        [("q", base_models["qwen2_vl"]), ("m", base_models["mllama"])],
        reward={"mode": "ring"},
        train={"max_steps": 2, "lr": 1e-2, "save_every": 1, "warmup_ratio": 0.0, **train},
    )
    cfg["members"][0]["lora"] = dict(LORA)
    return cfg


@pytest.fixture(scope="module")
def lora_run(base_models, tmp_path_factory) -> Path:
    """A 2-step ring cohort: q (Qwen2-VL) trains LoRA adapters, m (Mllama) trains fully."""
    tmp = tmp_path_factory.mktemp("lora")
    cfg = _config(tmp, base_models)
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    run_cohort(config_from_dict(cfg))
    return tmp / "run"


def test_only_the_adapters_train_and_the_checkpoint_is_a_peft_adapter(lora_run, base_models):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    step = lora_run / "checkpoints" / "step-2"
    q, m = step / "q", step / "m"
    assert not (q / "model.safetensors").exists() and (q / "adapter_config.json").is_file()
    adapter = load_file(q / "adapter_model.safetensors")
    base_file = base_models["qwen2_vl"] / "model.safetensors"
    assert (q / "adapter_model.safetensors").stat().st_size < base_file.stat().st_size / 10
    assert all(t.dtype == torch.float32 for t in adapter.values())
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # B starts at zero: it changed
    # the adapter loads onto its base with PEFT's own loader; the base's tensors are the base model's, bit for bit
    base = AutoModelForImageTextToText.from_pretrained(base_models["qwen2_vl"])
    peft_model = PeftModel.from_pretrained(base, str(q))
    original = AutoModelForImageTextToText.from_pretrained(base_models["qwen2_vl"]).state_dict()
    loaded = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in peft_model.state_dict().items()
        if "lora_" not in k
    }
    assert set(original) <= set(loaded)
    assert all(torch.equal(original[k], loaded[k]) for k in original)
    # the full member trained as before: its weights moved
    assert any(not torch.equal(t, weights(base_models["mllama"])[k]) for k, t in weights(m).items())


def test_merged_weights_are_peft_merge(tiny_zoo):
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), lora=LoraConfig(**LORA)))
    with torch.no_grad():
        for name, p in member.model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # B is zero at the start: give the merge something to add
    merged = {k: v.clone() for k, v in member.full_weights()}
    reference = member.peft.merge_and_unload().state_dict()
    assert set(merged) == set(reference)
    assert all(torch.allclose(merged[k].float(), reference[k].float(), atol=1e-6) for k in reference)
    adapted = [k for k in merged if k.endswith(".q_proj.weight")]
    plain = load_member(MemberConfig(id="p", model=str(tiny_zoo["qwen2_vl"]), trainable=False)).model.state_dict()
    assert set(merged) == set(plain)  # the base model's own names
    assert adapted and all(not torch.equal(merged[k], plain[k]) for k in adapted)


def test_merging_holds_a_layer_until_its_three_parts_arrive():
    a, b, w = torch.ones(2, 3), torch.full((4, 2), 0.5), torch.zeros(4, 3)
    stream = [("x.lora_B.default.weight", b), ("x.base_layer.bias", torch.ones(4)), ("x.lora_A.default.weight", a)]
    stream += [("y", torch.ones(1)), ("x.base_layer.weight", w)]
    out = dict(merged_weights(iter(stream), {"x": 2.0}))
    assert list(out) == ["x.bias", "y", "x.weight"]
    assert torch.equal(out["x.weight"], torch.full((4, 3), 2.0))  # 2 * (0.5 * 1 * 2)
    with pytest.raises(RuntimeError, match="missing parts"):
        list(merged_weights(iter(stream[:2]), {"x": 2.0}))


def test_merging_copies_the_held_parts_only_where_the_stream_releases_them(monkeypatch):
    """ZeRO-3's stream frees a gathered tensor once it moves on (zeroed here): the held parts must be copies
    then; a plain member's tensors stay valid, so they are held by reference (no copy of every projection)."""

    def releasing(stream):
        for name, tensor in stream:
            yield name, tensor
            tensor.zero_()  # the bucket is released

    def stream():
        return [("x.lora_B.default.weight", torch.full((4, 2), 0.5)), ("x.lora_A.default.weight", torch.ones(2, 3))] + [
            ("x.base_layer.weight", torch.zeros(4, 3))
        ]

    copied = dict(merged_weights(releasing(stream()), {"x": 2.0}, copy=True))
    assert torch.equal(copied["x.weight"], torch.full((4, 3), 2.0))
    by_reference = dict(merged_weights(releasing(stream()), {"x": 2.0}, copy=False))
    assert torch.equal(by_reference["x.weight"], torch.zeros(4, 3))  # what a released stream would give uncopied

    # the decision: Member.full_weights copies exactly when ZeRO-3 streams the weights
    import vlm_corl.members.member as member_module

    seen = []
    monkeypatch.setattr(member_module, "merged_weights", lambda raw, scaling, copy: seen.append(copy) or raw)
    monkeypatch.setattr(member_module, "named_tensors", lambda model: [])
    for stage, expected in ((None, False), (2, False), (3, True)):
        fake = member_module.Member.__new__(member_module.Member)
        fake.peft, fake.model, fake.lora_scaling = object(), None, {}
        fake.deepspeed = None if stage is None else type("DS", (), {"stage": stage, "full_weights": lambda self: []})()
        fake.full_weights()
        assert seen[-1] is expected, stage


def test_the_adapter_sync_under_zero3_gathers_the_adapters_alone(tiny_zoo, monkeypatch):
    """Review 2, 2b: a LoRA member serving its adapter (lora_sync: adapter) writes it at every sync; under ZeRO-3
    that gathered every base parameter to pick out a few MB. Only the trainable (adapter) parameters are
    gathered now, and the adapter is the same as from the whole stream."""
    import contextlib

    import deepspeed

    from vlm_corl.members.deepspeed_update import DeepSpeedUpdate

    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), lora=LoraConfig(r=4)))
    gathered = []

    def gather(params, modifier_rank=None):
        gathered.extend(params)
        return contextlib.nullcontext()

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gather)
    update = DeepSpeedUpdate.__new__(DeepSpeedUpdate)  # the stream alone, over the member's (unpartitioned) module
    update.stage, update.module, update.bucket_bytes = 3, member.model, 1 << 20
    member.deepspeed = update
    adapter = member.adapter_weights()
    adapters = [p for p in member.model.parameters() if p.requires_grad]
    assert adapters and [id(p) for p in gathered] == [id(p) for p in adapters]
    whole = adapter_tensors(named_tensors(member.model))
    assert sorted(adapter) == sorted(whole) and all(torch.equal(adapter[k], whole[k]) for k in whole)


def test_default_targets_are_the_language_models_projections(tiny_zoo):
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_5_vl"]), trainable=False))
    names = target_modules(member.model, LoraConfig())
    assert names and all(n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj") for n in names)  # fmt: skip
    assert not any(".visual." in n for n in names)  # Qwen2.5-VL's vision MLP has gate/up/down_proj too
    vision = target_modules(member.model, LoraConfig(vision=True))
    assert any(".visual." in n for n in vision) and set(names) < set(vision)
    # issue 46: a vision-only adapter could not be set up, and the message naming a tower layer did not say why
    alone = target_modules(member.model, LoraConfig(vision=True, target_modules=[]))
    assert alone and all(".visual." in n for n in alone) and set(alone) == set(vision) - set(names)
    with pytest.raises(UserError, match="'qkv': the vision tower's; .*target_modules: \\[\\] with it adapts the"):
        target_modules(member.model, LoraConfig(vision=True, target_modules=["qkv"]))
    raw = {"members": [{"id": "q", "model": str(tiny_zoo["qwen2_5_vl"]), "lora": {"target_modules": []}}]}
    with pytest.raises(ConfigError, match="lora.target_modules: \\[\\] adapts no layer .* lora.vision: true"):
        config_from_dict({**raw, "reward": {"mode": "gt"}})


def test_export_merge_gives_a_model_from_pretrained_loads_equal_to_the_member(lora_run, base_models, tmp_path, capsys):
    assert cli.run(export.main, [str(lora_run), "--out", str(tmp_path / "out"), "--merge"]) == 0
    assert (tmp_path / "out" / "m" / "model.safetensors").is_file()
    exported = load_member(MemberConfig(id="e", model=str(tmp_path / "out" / "q"), trainable=False))
    cfg = MemberConfig(id="q", model=str(base_models["qwen2_vl"]), lora=LoraConfig(**LORA))
    trained = load_member(cfg, lora_run / "checkpoints" / "step-2" / "q")  # the base + its checkpoint's adapter
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        assert torch.allclose(exported.model(input_ids=ids).logits, trained.model(input_ids=ids).logits, atol=1e-5)
    # without --merge: the adapter as it is, no optimizer state (in this process: the same main)
    assert cli.run(export.main, [str(lora_run), "--out", str(tmp_path / "adapters"), "--member", "q"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["q"]
    assert (tmp_path / "adapters" / "q" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapters" / "q" / "trainer_state.pt").exists()
    capsys.readouterr()
    assert cli.run(export.main, [str(lora_run), "--out", str(tmp_path / "x"), "--member", "nobody"]) == 2
    assert "--member nobody: not in" in capsys.readouterr().err and not (tmp_path / "x").exists()


def _files(folder: Path) -> dict[str, bytes]:
    """{relative path: content} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _logits(model_dir: Path) -> torch.Tensor:
    member = load_member(MemberConfig(id="e", model=str(model_dir), trainable=False))
    with torch.no_grad():
        return member.model(input_ids=torch.tensor([[1, 5, 9, 14, 3]])).logits


def test_export_into_a_used_folder_is_refused_and_overwrite_replaces_it_whole(lora_run, tmp_path, capsys):
    """Issue 32: an export never lands beside another one (adapter files next to full weights, loading the other
    export's weights); --overwrite leaves exactly the new export, byte for byte what a fresh folder gets."""

    def export_(out: Path, *flags: str) -> int:
        return cli.run(export.main, [str(lora_run), "--out", str(out), *flags])

    fresh = {}  # what each export writes into a new folder
    for name, flags in {"adapter": (), "merged": ("--merge", "--member", "q")}.items():
        assert export_(tmp_path / "fresh" / name, *flags) == 0
        fresh[name] = _files(tmp_path / "fresh" / name)
    assert "q/adapter_model.safetensors" in fresh["adapter"] and "q/model.safetensors" in fresh["merged"]
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is a new one
    assert export_(out) == 0 and _files(out) == fresh["adapter"]
    capsys.readouterr()
    assert export_(out, "--merge", "--member", "q") == 2
    err = capsys.readouterr().err
    assert f"error: --out {out} is not empty (it holds m, q)" in err and "--overwrite to replace it whole" in err
    assert "Traceback" not in err and _files(out) == fresh["adapter"]  # refused before writing anything
    # adapters -> merged weights: no adapter file beside the full weights, no member of the old export left
    assert export_(out, "--merge", "--member", "q", "--overwrite") == 0
    assert _files(out) == fresh["merged"]
    assert torch.equal(_logits(out / "q"), _logits(tmp_path / "fresh" / "merged" / "q"))
    # and back: no full weights beside the adapter
    assert export_(out, "--overwrite") == 0 and _files(out) == fresh["adapter"]
    assert torch.equal(_logits(out / "q"), _logits(tmp_path / "fresh" / "adapter" / "q"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]  # no temporary folder left beside it
    # --overwrite never deletes the checkpoint it exports
    shutil.copytree(lora_run / "checkpoints" / "step-2", tmp_path / "ckpt")
    capsys.readouterr()
    assert cli.run(export.main, [str(tmp_path / "ckpt"), "--out", str(tmp_path), "--overwrite"]) == 2
    assert "holds the checkpoint being exported" in capsys.readouterr().err and (tmp_path / "ckpt" / "q").is_dir()


def test_a_failed_overwrite_leaves_the_old_export_as_it_was(lora_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert cli.run(export.main, [str(lora_run), "--out", str(out)]) == 0
    before = _files(out)

    def crash(source, target, merge):
        (target / "partial.bin").parent.mkdir(parents=True)
        (target / "partial.bin").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "export_member", crash)
    with pytest.raises(OSError, match="No space left"):
        export.main([str(lora_run), "--out", str(out), "--overwrite", "--merge"])
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_lora_checkpoint_evaluates_like_a_model(lora_run, tmp_path):
    from vlm_corl.commands import eval as evaluate

    out = tmp_path / "eval"
    argv = ["--models", str(lora_run), "--benchmarks", "easyvqa", "--limit", "3", "--out", str(out)]
    assert cli.run(evaluate.main, argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert {Path(k).name for k in results} == {"q", "m"}
    # one member's adapter directory alone, as a user points at it
    adapter = sorted((lora_run / "checkpoints").iterdir())[-1] / "q"
    argv = ["--models", str(adapter), "--benchmarks", "easyvqa", "--limit", "3", "--out", str(tmp_path / "one")]
    assert cli.run(evaluate.main, argv) == 0
    alone = json.loads((tmp_path / "one" / "results.json").read_text())
    assert alone[str(adapter)] == results[str(adapter)]


def test_resume_of_a_lora_member_is_bit_identical(lora_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    shutil.rmtree(run / "checkpoints" / "step-2")  # as if the run had died during step 2
    cfg = yaml.safe_load((lora_run.parent / "c.yaml").read_text())
    cfg["output_dir"] = str(run)
    cfg["train"]["resume"] = True
    run_cohort(config_from_dict(cfg))
    for name in ("adapter_model.safetensors",):
        a = load_file(lora_run / "checkpoints" / "step-2" / "q" / name)
        b = load_file(run / "checkpoints" / "step-2" / "q" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert trained_fields(metrics(run)) == trained_fields(metrics(lora_run))


@pytest.mark.slow  # DeepSpeed in a subprocess per stage: in `make test-scale` with the other ZeRO runs
@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_deepspeed_trains_a_lora_member_on_a_bf16_base(base_models, tmp_path, zero):
    """As on a GPU: the base frozen in bf16 (its checkpoint's dtype), the adapters fp32, DeepSpeed over both."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    bf16 = tmp_path / "qwen_bf16"
    AutoModelForImageTextToText.from_pretrained(base_models["qwen2_vl"], dtype=torch.bfloat16).save_pretrained(bf16)
    AutoProcessor.from_pretrained(base_models["qwen2_vl"]).save_pretrained(bf16)
    member = load_member(MemberConfig(id="q", model=str(bf16), lora=LoraConfig(**LORA)))
    assert {p.dtype for p in member.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    cfg = _config(
        tmp_path,
        {**base_models, "qwen2_vl": bf16},
        deepspeed=str(ROOT / "configs" / "deepspeed" / f"{zero}.json"),
        max_steps=1,
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = python_m("vlm_corl.train", "--config", path)
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = load_file(tmp_path / "run" / "checkpoints" / "step-1" / "q" / "adapter_model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)


def test_the_planner_counts_adapters_not_the_whole_model(tiny_zoo, tmp_path):
    from vlm_corl.planning.cohort import Hardware, plan_cohort

    full = config_from_dict(cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_vote"}))
    lora = replace(full, members=[replace(full.members[0], lora=LoraConfig(**LORA))])
    hw = Hardware(processes=1, device_bytes=80e9, cuda=True)

    def parts(cfg):
        return {i.part: i.bytes for i in plan_cohort(cfg, hw).ranks[0].items}

    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), lora=LoraConfig(**LORA)))
    adapters = sum(p.numel() for p in member.model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in member.model.parameters() if not p.requires_grad)
    got, whole = parts(lora), parts(full)
    assert got["optimizer"] == 8 * adapters and got["gradients"] == 4 * adapters
    assert got["weights"] == 4 * base + 4 * adapters  # the tiny base is fp32 on disk
    assert whole["optimizer"] == 8 * base


def test_a_lora_target_that_matches_no_layer_names_it_and_the_layers_there_are(tiny_zoo):
    """A typo in lora.target_modules used to adapt only the entries that matched, silently."""
    from vlm_corl.errors import UserError

    typo = LoraConfig(r=4, target_modules=["q_proj", "v_prj"])
    with pytest.raises(UserError) as err:
        load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), lora=typo))
    text = str(err.value)
    assert text.startswith("member 'q': lora.target_modules: 'v_prj' matches no linear layer of the language model")
    assert "q_proj" in text and "v_proj" in text and "down_proj" in text  # the names that exist
    assert "'q_proj'" not in text.split("named")[0]  # the one that matched is not blamed
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False))
    assert target_modules(member.model, LoraConfig(target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("trainable", [True, False])
def test_a_truncated_adapter_file_names_the_member_and_its_directory(lora_run, base_models, tmp_path, trainable):
    """Resuming a LoRA member (trainable) or loading its checkpoint as a frozen peer or for export (merged)
    from a torn adapter file: a MemberLoadError (exit 2) naming the directory, not safetensors' own error."""
    from vlm_corl.members.member import MemberLoadError

    torn = tmp_path / "q"
    shutil.copytree(lora_run / "checkpoints" / "step-2" / "q", torn)
    data = (torn / "adapter_model.safetensors").read_bytes()
    (torn / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    if trainable:  # resuming: the member's base, its adapter read from the checkpoint
        cfg = MemberConfig(id="q", model=str(base_models["qwen2_vl"]), lora=LoraConfig(**LORA))
    else:
        cfg = MemberConfig(id="q", model=str(torn), trainable=False)
    with pytest.raises(MemberLoadError, match=rf"member 'q': cannot apply the adapter in {torn}"):
        load_member(cfg, torn)


def test_lora_on_a_frozen_member_is_a_config_error(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("m", tiny_zoo["mllama"])])
    cfg["members"][1].update(trainable=False, lora=LORA)
    with pytest.raises(ConfigError, match=r"members\[1\]\.lora: a frozen peer trains no adapters"):
        config_from_dict(cfg)
    cfg["members"][1].update(trainable=True, lora={"r": 0})
    with pytest.raises(ConfigError, match=r"members\[1\]\.lora\.r"):
        config_from_dict(cfg)


def test_scalings_are_alpha_over_r(tiny_zoo):
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), lora=LoraConfig(r=4, alpha=12.0)))
    assert set(scalings(member.model).values()) == {3.0}
    assert all(p.dtype == torch.float32 for p in member.model.parameters() if p.requires_grad)


def test_adapter_sync_needs_a_language_model_adapter_and_a_rank_vllm_serves(tiny_zoo, tmp_path):
    from vlm_corl.errors import UserError
    from vlm_corl.members.engines.vllm import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(UserError, match="up to rank 512"):
        vllm_lora_rank(513)
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("m", tiny_zoo["mllama"])])
    cfg["members"][0].update(lora={"vision": True}, engine="vllm")
    cfg["rollout"]["vllm"] = {"lora_sync": "adapter"}
    with pytest.raises(ConfigError, match=r"members\[0\]\.lora\.vision: vLLM serves adapters of the language model"):
        config_from_dict(cfg)
    cfg["rollout"]["vllm"]["lora_sync"] = "merged"
    config_from_dict(cfg)  # merged weights carry the vision tower's adapters too

"""The generic family (issue 34): architectures we register no family for, built tiny by `zoo --arch`, served from
their own processor and chat template; what it cannot serve refused with exit 2 before any weight loads.

The whole commands on these members (a cohort beside a registered member, checkpoint, resume, eval, plan, export
and reload with plain transformers) run in tests/test_generic_e2e.py (`make test-e2e`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import transformers
from cohort_helpers import ENV, ROOT, assert_ready_decode_mask_changes_nothing

from vlm_corl.config.schema import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.records import Example
from vlm_corl.members.batching import ready_decode_mask
from vlm_corl.members.engines.hf import HFEngine
from vlm_corl.members.families import MLLAMA, family_for_model_type
from vlm_corl.members.families.generic import TESTED_GENERIC, auto_class_for, end_of_turn
from vlm_corl.members.member import MemberLoadError, load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.models import coverage
from vlm_corl.models.arch import ArchUnavailable, build_arch
from vlm_corl.models.coverage import architectures
from vlm_corl.models.coverage import (
    tested_architectures as architectures_tested_here,  # not test_*: pytest would collect it
)
from vlm_corl.registry import FAMILIES

# The architectures with no registered family that docs/models.md marks tested: vision, then text.
GENERIC_VISION = tuple(a for a in TESTED_GENERIC if auto_class_for(a)[0] == "vision")
GENERIC_TEXT = tuple(a for a in TESTED_GENERIC if auto_class_for(a)[0] == "text")


@pytest.fixture(scope="module")
def generic_zoo(tmp_path_factory) -> dict:
    """{model_type: directory} of a tiny member of each generic architecture (~3 s each)."""
    out = tmp_path_factory.mktemp("generic")
    return {arch: _built(arch, out / arch) for arch in GENERIC_VISION + GENERIC_TEXT}


def _built(arch, path):
    build_arch(arch, path)
    return path


def test_the_tested_architectures_have_no_registered_family():
    """Otherwise these tests would not be testing the generic path."""
    for arch in GENERIC_VISION + GENERIC_TEXT:
        with pytest.raises(ValueError, match="no model family"):
            family_for_model_type(arch)


@pytest.mark.parametrize("arch", GENERIC_VISION + GENERIC_TEXT)
def test_a_generic_member_renders_with_its_own_template_and_samples(generic_zoo, arch):
    """The member loads as `generic` with the modality of its Auto class; its stop tokens include the end of turn
    its chat template writes (<|im_end|>, which the generation config of a base model need not name); the
    processor's image token is never sampled; a prompt is rendered by its own template with the image expanded to
    the processor's tokens, and the HF engine samples a response that stops within the budget."""
    member = load_member(MemberConfig(id="g", model=str(generic_zoo[arch]), trainable=False))
    vision = arch in GENERIC_VISION
    assert (member.family.name, member.family.modality) == ("generic", "vision" if vision else "text")
    im_end = member.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert member.eos_token_ids[0] == im_end and im_end not in member.suppressed_ids
    example = load_examples("easyvqa", split="train", limit=1).examples[0] if vision else Example("a", "2+2?")
    prompt = Renderer(member, "original", 1 << 20, 1 << 14)(example)
    ids = prompt.inputs["input_ids"][0].tolist()
    if vision:  # what the processor expands an image into (Aya Vision: <|IMG_PATCH|>, not its <image>)
        image = member.processor.image_token
        image_id = getattr(member.processor, "image_token_id", None) or member.tokenizer.convert_tokens_to_ids(image)
        assert image_id in member.suppressed_ids and ids.count(image_id) > 1  # expanded by the processor
    assert member.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    torch.manual_seed(0)
    (group,) = HFEngine(member).generate([prompt], SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
    assert [len(r.token_ids) <= 4 for r in group.responses] == [True, True]
    assert not set(member.suppressed_ids) & {t for r in group.responses for t in r.token_ids}


def test_family_generic_serves_a_registered_architecture_too(tiny_zoo):
    """`members[i].family: generic` on a Qwen2-VL member: its own template and tokens, not the family table."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), family="generic", trainable=False))
    assert member.family.name == "generic" and member.family.auto_model == "AutoModelForImageTextToText"
    assert member.eos_token_ids[0] == member.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_the_end_of_turn_is_read_from_the_chat_template():
    """Llama-3's template closes an assistant turn with <|eot_id|>; a template without a close gives None."""
    tokenizer = MLLAMA.build_tokenizer()
    assert end_of_turn(tokenizer, tokenizer) == tokenizer.convert_tokens_to_ids("<|eot_id|>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert end_of_turn(tokenizer, tokenizer) is None


@pytest.mark.parametrize("arch", GENERIC_VISION + GENERIC_TEXT)
def test_a_generic_member_decodes_with_a_ready_made_mask_only_where_one_mask_serves_every_layer(generic_zoo, arch):
    """Qwen3.5's linear-attention layers take a 2-D mask of their own (padded states are zeroed), Aya Vision's
    Cohere2 has sliding-window layers: no ready-made 4-D mask for them. Every other architecture here decodes a
    padded batch with it as with transformers' own."""
    member = load_member(MemberConfig(id="g", model=str(generic_zoo[arch]), trainable=False))
    own_masks = arch in ("qwen3_5", "aya_vision")
    assert ready_decode_mask(member.model.config) == (not own_masks)
    if own_masks:
        return
    examples = load_examples("easyvqa", split="train", limit=2).examples
    if arch in GENERIC_TEXT:
        examples = [Example(e.id, e.question) for e in examples]
    examples[1] = replace(examples[1], question=examples[1].question + " Say why, in one word.")
    render = Renderer(member, "original", 1 << 20, 1 << 14)
    assert_ready_decode_mask_changes_nothing(member, [render(e) for e in examples])


def test_a_generic_checkpoint_without_a_chat_template_is_refused(generic_zoo, tmp_path):
    """Named at load, before any weight is read: what is missing and how to add it."""
    copy = shutil.copytree(generic_zoo["llava_onevision"], tmp_path / "llava")
    (copy / "chat_template.jinja").unlink()
    with pytest.raises(MemberLoadError, match="generic family serves a 'llava_onevision' model.*only with a chat"):
        load_member(MemberConfig(id="g", model=str(copy)))


def test_a_type_no_auto_class_loads_is_refused(tmp_path):
    """A config.json of an architecture neither Auto class knows: the member and what is wrong, not a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "vit"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(MemberLoadError, match="'vit' has no registered family and is neither"):
        load_member(MemberConfig(id="b", model=str(tmp_path)))


def test_zoo_arch_says_why_it_cannot_build_an_architecture(tmp_path):
    """exit 2 and the reason, for an unknown type and for a processor that names no image token (BLIP)."""
    for arch, reason in (("not_a_model", "is not an image-text-to-text or causal-LM"), ("blip", "no image_token")):
        done = subprocess.run(
            [sys.executable, "-m", "vlm_corl.zoo", "--arch", arch, "--out", str(tmp_path / arch)],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 2 and reason in done.stderr and "Traceback" not in done.stderr
    # whatever step fails (the shrunk config, the processor, saving), the builder says so, never a raw error
    for arch, reason in (("mamba", "no shrunk config"), ("evolla", "no offline processor"), ("zaya", "load back")):
        with pytest.raises(ArchUnavailable, match=reason):
            build_arch(arch, tmp_path / "again" / arch)


def test_generic_is_not_a_registered_family_the_zoo_would_build():
    """The generic family exists per checkpoint; `zoo` without --arch builds registered families only."""
    assert "generic" not in FAMILIES.names()


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in rows[1:]}  # rows[0]: the header


def test_the_coverage_table_lists_every_architecture_the_installed_transformers_knows():
    """docs/models.md: one row per architecture the Auto classes load, the registered family or generic, tested
    exactly where the tests run it, a zoo that builds every tested generic one; the counts add up. Regenerate it
    with `make models-doc` after a transformers upgrade or a new family."""
    text = (ROOT / "docs" / "models.md").read_text()
    version = transformers.__version__
    if f"against transformers {version}" not in text:
        pytest.skip(f"docs/models.md was generated against another transformers than {version}: make models-doc")
    rows = _table_rows(text)
    assert set(rows) == set(architectures())
    tested = architectures_tested_here()
    for arch, (_, modality, served_by, zoo, tested_here, _, _) in rows.items():
        try:
            family = family_for_model_type(arch).name
        except ValueError:
            family = "generic"
        assert (modality, served_by, tested_here) == (architectures()[arch][0], family, "yes" if arch in tested else "")
        assert zoo == "builds" or served_by != "generic" or arch not in TESTED_GENERIC
    counts = coverage._counts([coverage.Row(*cells) for cells in rows.values()])
    assert f"- served generically and tested here: {counts['generic tested']}" in text
    assert coverage.VLLM_COLUMN in text  # what the vLLM column means, as the generator writes it


def test_the_coverage_command_writes_a_row(tmp_path):
    """`python -m vlm_corl.coverage` at its smallest: one registered and one generic architecture."""
    out = tmp_path / "models.md"
    assert coverage.main(["--out", str(out), "--only", "qwen2_vl,smollm3"]) == 0
    rows = _table_rows(out.read_text())
    assert rows["qwen2_vl"][2:5] == ["qwen2_vl", "zoo --families qwen2_vl", "yes"]
    assert rows["smollm3"][2:5] == ["generic", "builds", "yes"] and "q_proj" in rows["smollm3"][6]


@pytest.mark.parametrize("arch", ["llava_onevision", "idefics3"])
def test_a_generic_member_trains_lora_adapters_on_its_language_model_only(generic_zoo, arch):
    """The default LoRA targets of a generic VLM: the language model's projections (Idefics3's SigLIP tower in
    `vision_model` has q/k/v_proj too, and gets none); a loss on a rendered image prompt reaches the adapters
    alone, the frozen base and the vision tower get no gradient."""
    from vlm_corl.config.schema import LoraConfig

    member = load_member(MemberConfig(id="g", model=str(generic_zoo[arch]), lora=LoraConfig(r=4)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in member.model.named_parameters() if ".lora_A." in n}
    assert adapted and not any(part in n for n in adapted for part in ("vision_tower", "vision_model"))
    example = load_examples("easyvqa", split="train", limit=1).examples[0]
    inputs = Renderer(member, "original", 1 << 20, 1 << 14)(example).inputs
    member.model(**inputs).logits[:, -1].logsumexp(-1).sum().backward()
    grads = {n for n, p in member.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all("lora_" in n for n in grads)


@pytest.mark.parametrize("arch", GENERIC_VISION)
def test_the_planner_asks_a_generic_members_own_processor_how_many_tower_positions_an_image_makes(
    generic_zoo, arch, tmp_path
):
    """No family knows how a generic tower tiles an image, so the planner puts images of the pixel cap (square,
    wide, tall, and the aspects between: Aya Vision's tiler makes the most tiles of a 4:3 image) through the
    member's own image processor. Its count is the most that images rendered for training (files shrunk to the
    cap, then the processor) make, and for tiling processors (LLaVA-OneVision's grid, Idefics3's splitting) more
    than the pixel count alone would plan."""
    from PIL import Image

    from vlm_corl.planning.shapes import ASPECTS, model_shape, tower_positions

    cap = 96 * 96
    shape = model_shape(str(generic_zoo[arch]))
    assert shape.processor_dir == str(generic_zoo[arch])
    member = load_member(MemberConfig(id="g", model=str(generic_zoo[arch]), trainable=False))
    render = Renderer(member, "original", cap, 1 << 20)
    seen = []
    at_cap = [(round((cap * a) ** 0.5), cap // round((cap * a) ** 0.5)) for a in ASPECTS]  # as the planner makes them
    for i, size in enumerate([*at_cap, (400, 300), (40, 30), (300, 200), (50, 150)]):
        Image.new("RGB", size, (200, 30 * i, 0)).save(tmp_path / f"{i}.png")
        prompt = render(Example(str(i), "What colour?", images=(str(tmp_path / f"{i}.png"),)))
        seen.append(tower_positions(prompt.inputs, shape.patch_size))
    assert max(seen) == shape.patches_per_image(cap), seen
    if arch in ("llava_onevision", "idefics3", "aya_vision"):
        assert shape.patches_per_image(cap) > cap / shape.patch_size**2  # what the pixel count alone would plan


def test_a_processor_that_cannot_count_falls_back_to_the_pixel_count_and_says_so(generic_zoo, tmp_path, caplog):
    from vlm_corl.planning.shapes import processor_patches

    broken = shutil.copytree(generic_zoo["llava_onevision"], tmp_path / "llava")
    (broken / "processor_config.json").write_text("{not json")
    assert processor_patches(str(broken), 14, 96 * 96) == 0
    assert "did not count an image's vision-tower positions" in caplog.text and str(broken) in caplog.text


def test_corl_plan_reads_a_gpt2_style_config(tmp_path, capsys):
    """GPT-2 names its sizes n_embd, n_layer, n_head and n_inner (None: 4 x n_embd) and has no intermediate_size:
    the planner reads them through the config's standard names, its own where there is none."""
    import yaml

    from vlm_corl.commands.plan import main as plan_main
    from vlm_corl.planning.shapes import model_shape

    build_arch("gpt2", tmp_path / "gpt2")
    wider = shutil.copytree(tmp_path / "gpt2", tmp_path / "gpt2-wider")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "n_inner": 96}))
    shape = model_shape(str(tmp_path / "gpt2"))
    dims = (shape.hidden, shape.layers, shape.intermediate, shape.kv_heads, shape.head_dim, shape.vocab)
    assert dims == (64, 2, 4 * 64, 4, 16, config["vocab_size"])
    assert model_shape(str(wider)).intermediate == 96
    cohort = {
        "members": [{"id": "g", "model": str(tmp_path / "gpt2")}, {"id": "w", "model": str(wider)}],
        "data": {"train": {"loader": "math500", "split": "test"}, "batch_size": 2},
        "rollout": {"n": 2, "max_new_tokens": 6},
    }
    (tmp_path / "cohort.yaml").write_text(yaml.safe_dump(cohort))
    assert plan_main(["--config", str(tmp_path / "cohort.yaml"), "--gpus-per-node", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True


def test_zoo_arch_names_the_package_smolvlms_processor_needs(tmp_path, monkeypatch):
    """SmolVLM's processor refuses to build without num2words (it spells out video frame counts): the refusal
    names the package, not a missing image token (docs/models.md)."""
    from transformers.models.smolvlm import processing_smolvlm

    monkeypatch.setattr(processing_smolvlm, "num2words", None)  # as where the package is not installed
    with pytest.raises(ArchUnavailable, match=r"^smolvlm: its processor SmolVLMProcessor needs a package.*num2words"):
        build_arch("smolvlm", tmp_path / "smolvlm")
    assert not (tmp_path / "smolvlm").exists() or not any((tmp_path / "smolvlm").iterdir())


@pytest.mark.parametrize("arch", ["aya_vision", "smolvlm"])
def test_aya_vision_and_smolvlm_members_train_two_steps_in_a_cohort(tiny_zoo, tmp_path, monkeypatch, arch):
    """Aya Vision: its processor expands an image into <|IMG_PATCH|> tokens (the config's image token id points
    there, not at <image>), tiles of the tower's image size, pixel-shuffled by its downsample factor. SmolVLM:
    its processor needs num2words (a dependency since issue 46). Each trains two steps beside a registered
    member, and its weights move."""
    from cohort_helpers import cohort, metrics, weights

    from vlm_corl import CohortTrainer

    build_arch(arch, tmp_path / arch)
    cfg = cohort(
        tmp_path,
        [("g", tmp_path / arch), ("peer", tiny_zoo["qwen2_vl"])],
        data={"train": {"loader": "easyvqa", "limit": 8}, "batch_size": 2},
        rollout={"n": 2, "max_new_tokens": 6},
        reward={"mode": "entropy"},  # every response rewarded apart: a gradient each step
    )
    cfg["train"].update(save_every=2, lr=1e-2)
    CohortTrainer(cfg).train()
    assert sorted((r["step"], r["member"]) for r in metrics(tmp_path / "run")) == [
        (s, m) for s in (1, 2) for m in ("g", "peer")
    ]
    trained = weights(tmp_path / "run" / "checkpoints" / "step-2" / "g")
    assert any(not torch.equal(trained[k], v) for k, v in weights(tmp_path / arch).items())

"""The offline tiny-model zoo and the family registry: every family builds, reloads with the Auto classes,
renders chat prompts, generates (batched, left-padded, no control tokens) and scores its own samples."""

from __future__ import annotations

import json

import pytest
import torch
from cohort_helpers import shipped_families
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)

from vlm_corl import cli
from vlm_corl.commands.zoo import main
from vlm_corl.members.families import TEXT_DIMS, detect_family, family_for_model_type
from vlm_corl.members.families.qwen import mrope_section
from vlm_corl.members.families.tokenizer import BASE_VOCAB_SIZE, FORMAT_TOKENS, _trained_bpe
from vlm_corl.models.zoo import build_member, member_dir
from vlm_corl.registry import FAMILIES

VISION_FAMILIES = shipped_families("vision")
TEXT_FAMILIES = shipped_families("text")
QUESTIONS = ("What shape is in the image?", "Does the image contain a red circle?")
VLLM_HEAD_DIMS = {32, 64, 80, 96, 112, 128}


def _vision_batch(processor):
    """Two chat-templated prompts with one 64x64 image each, processed as one left-padded batch."""
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in QUESTIONS
    ]
    images = [[Image.new("RGB", (64, 64), "red")], [Image.new("RGB", (64, 64), "blue")]]
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def _text_batch(tokenizer):
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("What is 2 + 2?", r"Let's think step by step and output the final answer within \boxed{}. 3 * 7?")
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


def _with_completion(inputs, new_ids):
    """The prompt batch followed by generated tokens, as the policy forward pass of RL sees it."""
    n = new_ids.shape[1]
    out = dict(inputs, input_ids=torch.cat([inputs["input_ids"], new_ids], 1))
    out["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(new_ids)], 1)
    for key in ("mm_token_type_ids", "token_type_ids"):  # generated tokens are text
        if key in out:
            out[key] = torch.cat([inputs[key], torch.zeros_like(new_ids)], 1)
    if "cross_attention_mask" in out:  # Mllama: generated tokens see the images the last prompt token sees
        mask = inputs["cross_attention_mask"]
        out["cross_attention_mask"] = torch.cat([mask, mask[:, -1:].expand(-1, n, -1, -1)], 1)
    return out


def _until_eos(new_ids, eos_ids):
    """(B, T) bool: tokens up to and including each row's first eos (generate pads after it)."""
    is_eos = torch.isin(new_ids, torch.tensor(eos_ids))
    after = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return ~after


def test_tokenizer_training_is_deterministic_and_learns_the_corpus():
    assert _trained_bpe.__wrapped__(BASE_VOCAB_SIZE) == _trained_bpe(BASE_VOCAB_SIZE)
    tok = FAMILIES.get("qwen2_vl").build_tokenizer()
    assert tok.padding_side == "left"
    for tag in FORMAT_TOKENS:  # single, ordinary tokens: decoded even with skip_special_tokens
        assert len(tok(tag).input_ids) == 1
        assert tok.decode(tok(tag).input_ids, skip_special_tokens=True) == tag
    assert len(tok("What shape is in the image?").input_ids) <= 8
    text = r"The answer is \boxed{\frac{14}{3}} <|im_end|>"
    assert tok.decode(tok(text).input_ids) == text


def test_registry_has_every_family_and_detects_members(tiny_zoo):
    assert set(tiny_zoo) == set(VISION_FAMILIES + TEXT_FAMILIES) <= set(FAMILIES.names())
    for name in VISION_FAMILIES + TEXT_FAMILIES:
        family = FAMILIES.get(name)
        assert family.name == name
        assert (family.modality, family.prompt_style, family.auto_model) == (
            ("vision", "answer_tags", "AutoModelForImageTextToText")
            if name in VISION_FAMILIES
            else ("text", "boxed", "AutoModelForCausalLM")
        )
        assert detect_family(tiny_zoo[name]) is family
    assert family_for_model_type("qwen3_vl_moe").name == "qwen3_vl"
    with pytest.raises(ValueError, match="no model family for model_type 'bert'"):
        family_for_model_type("bert")


@pytest.mark.parametrize("name", VISION_FAMILIES + TEXT_FAMILIES)
def test_member_reloads_generates_and_scores_its_samples(tiny_zoo, name):
    path = tiny_zoo[name]
    family = FAMILIES.get(name)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type in family.model_types
    if family.modality == "vision":
        model = AutoModelForImageTextToText.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
        assert processor.chat_template == family.chat_template  # saved by processor.save_pretrained
        tokenizer = processor.tokenizer
        inputs = _vision_batch(processor)
        image_id = config.image_token_id
        n_image_tokens = (inputs["input_ids"] == image_id).sum(1)
        expected = 1 if name == "mllama" else 16  # Mllama cross-attends to the image instead
        assert n_image_tokens.tolist() == [expected, expected]
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert tokenizer.chat_template == family.chat_template
        inputs = _text_batch(tokenizer)
    assert (path / "chat_template.jinja").is_file()
    assert tokenizer.padding_side == "left"
    assert inputs["attention_mask"][:, 0].tolist() != inputs["attention_mask"][:, -1].tolist()  # really padded

    model.eval()
    gen = model.generation_config
    assert gen.pad_token_id == tokenizer.pad_token_id and tokenizer.eos_token_id in gen.eos_token_id
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=True, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, inputs["input_ids"].shape[1] :]
    valid = _until_eos(new, gen.eos_token_id)
    assert not set(new[valid].tolist()) & set(gen.suppress_tokens)

    # The policy forward pass over prompt + samples reproduces the sampling logits (what RL's ratios need).
    with torch.no_grad():
        logits = model(**_with_completion(inputs, new)).logits
    prompt_len = inputs["input_ids"].shape[1]
    scored = logits[:, prompt_len - 1 : -1]
    sampled = torch.stack(out.logits, dim=1)
    assert torch.allclose(scored[valid], sampled[valid], atol=1e-4)


def test_control_tokens_are_never_sampled(tiny_zoo):
    path = tiny_zoo["qwen2_vl"]
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = _vision_batch(processor)
    suppressed = set(model.generation_config.suppress_tokens)
    control = set(processor.tokenizer.all_special_ids) - set(model.generation_config.eos_token_id)
    assert control == suppressed

    def sample(**overrides):
        torch.manual_seed(0)
        out = model.generate(
            **inputs, max_new_tokens=256, min_new_tokens=256, do_sample=True, num_return_sequences=4, **overrides
        )
        return set(out[:, inputs["input_ids"].shape[1] :].flatten().tolist())

    assert not sample() & suppressed  # 2048 samples from a near-uniform random model
    assert sample(suppress_tokens=None) & suppressed  # the same draw without suppression does hit them


def test_same_seed_gives_identical_weights(tiny_zoo, tmp_path):
    family = FAMILIES.get("qwen2")
    build_member(family, tmp_path / "again", seed=0)
    build_member(family, tmp_path / "other", seed=1)
    weights = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert weights(tmp_path / "again") == weights(tiny_zoo["qwen2"])
    assert weights(tmp_path / "other") != weights(tiny_zoo["qwen2"])


def test_small_configs_suit_vllm_cpu_attention():
    assert TEXT_DIMS["small"].head_dim in VLLM_HEAD_DIMS
    for name in VISION_FAMILIES + TEXT_FAMILIES:
        family = FAMILIES.get(name)
        config = family.build_config("small", family.build_tokenizer())
        text = config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        assert head_dim in VLLM_HEAD_DIMS, name
        section = (text.rope_parameters or {}).get("mrope_section")
        if section is not None:
            assert sum(section) == head_dim // 2, name
    assert mrope_section(128) == [16, 24, 24]  # Qwen2-VL's released split


def test_small_member_generates(tmp_path):
    family = FAMILIES.get("qwen2_5_vl")
    path = member_dir(tmp_path, family.name, "small")
    n_params = build_member(family, path, size="small")
    assert path.name == "qwen2_5_vl-small" and n_params > 1_000_000
    model, processor = family.load(path)
    inputs = _vision_batch(processor)
    assert (inputs["input_ids"] == model.config.image_token_id).sum().item() == 2 * 16
    out = model.eval().generate(**inputs, max_new_tokens=8, do_sample=True)
    assert out.shape[0] == 2


def test_cli_builds_prints_table_and_rejects_unknown_family(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--families", "llama,gemma3", "--seed", "3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["family", "path", "parameters"]
    assert [row.split()[0] for row in table[1:]] == ["llama", "gemma3"]
    assert json.loads((tmp_path / "gemma3" / "config.json").read_text())["model_type"] == "gemma3"
    assert cli.run(main, ["--out", str(tmp_path), "--families", "qwen2vl"]) == 2
    assert "Did you mean 'qwen2_vl'?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_the_zoo_refuses_a_folder_holding_files_it_did_not_write_and_leaves_them(tmp_path, capsys):
    """`--arch` writes into OUT itself: another model's files there would sit beside the new one's (a stale
    preprocessor_config.json, weight shards). Exit 2 naming the folder, what is there and the fix; nothing deleted.
    The same for a family's folder OUT/<family>."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "llama"}')
    (mine / "notes.txt").write_text("my notes")
    before = _files(mine)
    assert cli.run(main, ["--arch", "olmo2", "--out", str(mine)]) == 2
    err = capsys.readouterr().err
    assert f"{mine} holds files the zoo did not write (config.json, notes.txt)" in err
    assert "give --out an empty or new folder" in err and "Traceback" not in err
    assert _files(mine) == before
    (tmp_path / "zoo" / "qwen3").mkdir(parents=True)
    (tmp_path / "zoo" / "qwen3" / "weights.bin").write_bytes(b"mine")
    assert cli.run(main, ["--out", str(tmp_path / "zoo"), "--families", "qwen3"]) == 2
    assert f"{tmp_path / 'zoo' / 'qwen3'} holds files the zoo did not write (weights.bin)" in capsys.readouterr().err
    assert _files(tmp_path / "zoo" / "qwen3") == {"weights.bin": b"mine"}


def test_the_zoo_replaces_its_own_earlier_build_leaving_none_of_its_files(tiny_zoo, tmp_path):
    """A VLM built by `--arch`, then a text model into the same folder: exactly the files a fresh build of the
    text model writes, none of the VLM's (its processor files would make it look like a VLM)."""
    assert cli.run(main, ["--arch", "llava_onevision", "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "processor_config.json").is_file()
    assert cli.run(main, ["--arch", "olmo2", "--out", str(tmp_path / "m")]) == 0
    assert cli.run(main, ["--arch", "olmo2", "--out", str(tmp_path / "fresh")]) == 0
    assert set(_files(tmp_path / "m")) == set(_files(tmp_path / "fresh"))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "olmo2"
    family = FAMILIES.get("qwen3")  # a family's member rebuilt in place, as base_models does
    build_member(family, tmp_path / "q", seed=1)
    build_member(family, tmp_path / "q", seed=0)
    rebuilt, fresh = _files(tmp_path / "q"), _files(tiny_zoo["qwen3"])
    assert set(rebuilt) == set(fresh) and rebuilt["model.safetensors"] == fresh["model.safetensors"]

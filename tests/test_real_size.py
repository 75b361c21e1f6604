"""Real architectures without downloads: `python -m vlm_corl.zoo --real NAME` builds a member with a released
model's dimensions, vocabulary and image processor and random weights (the GPU check trains two at full size).
Here the same path runs on configs shrunk to a few layers, so the released processors, the token-id remap and
rendering are checked on a CPU; the full sizes instantiate on the meta device (test_memory_arithmetic)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.engines import make_engine
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.models.zoo import build_real

ROOT = Path(__file__).resolve().parents[1]
SHRINK = {
    "qwen2-vl-2b-instruct": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64},
    },
    "internvl3-2b-hf": {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
    },
}


def shrunk(name: str, tmp_path: Path) -> Path:
    """configs/models/NAME with a few small layers: the released vocabulary, processor and token ids."""
    out = tmp_path / name
    out.mkdir()
    config = json.loads((ROOT / "configs" / "models" / name / "config.json").read_text())
    for key, value in SHRINK[name].items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key.endswith("_config") else value
    (out / "config.json").write_text(json.dumps(config))
    (out / "preprocessor_config.json").write_text(
        (ROOT / "configs" / "models" / name / "preprocessor_config.json").read_text()
    )
    return out


@pytest.mark.parametrize("name", sorted(SHRINK))
def test_a_released_architecture_builds_loads_renders_and_samples(name, tmp_path):
    path, n_params = build_real(shrunk(name, tmp_path), tmp_path / "built", dtype=torch.float32)
    member = load_member(MemberConfig(id="m", model=str(path)))
    assert member.model.config.get_text_config().vocab_size > 150_000  # the released vocabulary
    token = dict(member.family.config_token_ids)["image_token_id"]
    assert member.model.config.image_token_id == member.tokenizer.convert_tokens_to_ids(token)
    example = load_examples("easyvqa", split="test", limit=1).examples[0]
    prompt = Renderer(member, "original", 10**6, 10**6)(example)
    image_tokens = int((prompt.inputs["input_ids"] == member.model.config.image_token_id).sum())
    # Qwen2-VL's released min_pixels lifts a 64x64 picture to 56x56 (2x2 merged tokens); InternVL reads 448-px
    # tiles of 256 tokens each
    assert image_tokens == (4 if name.startswith("qwen") else 256 * (prompt.inputs["pixel_values"].shape[0]))
    groups = make_engine("hf", member).generate([prompt], SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert all(0 < len(r.token_ids) <= 3 for r in groups[0].responses)
    assert not set(member.suppressed_ids) & {t for r in groups[0].responses for t in r.token_ids}


def test_the_zoo_command_names_the_architectures_it_knows(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vlm_corl.zoo", "--out", str(tmp_path), "--real", "gpt-5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "qwen2-vl-2b-instruct" in proc.stderr and "Traceback" not in proc.stderr

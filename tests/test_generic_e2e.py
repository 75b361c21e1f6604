"""Architectures we register no family for, end to end through the commands a user runs (issue 34; `make test-e2e`):
`zoo --arch`, a 2-step cohort beside a registered member with a checkpoint per step, a resume to step 3, `corl eval`
on the checkpoint, `corl plan`, `corl export`, and the export reloaded and sampled with plain transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from cohort_helpers import ENV, ROOT, metrics
from safetensors.torch import load_file
from test_generic_family import GENERIC_TEXT, GENERIC_VISION

pytestmark = pytest.mark.slow


def corl(*args: str) -> subprocess.CompletedProcess:
    """`corl ARGS` as a user runs it; fails the test with its output when it does not exit 0."""
    done = subprocess.run(
        [str(Path(sys.executable).with_name("corl")), *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"corl {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.mark.parametrize("arch", GENERIC_VISION + GENERIC_TEXT)
def test_a_generic_member_trains_resumes_evaluates_plans_and_exports(tiny_zoo, tmp_path, arch):
    vision = arch in GENERIC_VISION
    corl("zoo", "--arch", arch, "--out", str(tmp_path / arch))
    peer = tiny_zoo["qwen2_vl" if vision else "qwen3"]
    config = {
        "output_dir": str(tmp_path / "run"),
        "members": [{"id": "g", "model": str(tmp_path / arch)}, {"id": "peer", "model": str(peer)}],
        "data": {
            "train": {"loader": "easyvqa", "limit": 32} if vision else {"loader": "math500", "split": "test"},
            "batch_size": 2,
        },
        "rollout": {"n": 2, "max_new_tokens": 6},
        "reward": {"mode": "ring"},
        "train": {"max_steps": 2, "lr": 1e-3, "save_every": 1, "warmup_ratio": 0.0},
        "logging": {"report_to": [], "progress": False},
    }
    path = tmp_path / "cohort.yaml"
    path.write_text(yaml.safe_dump(config))
    trained = corl("train", "--config", str(path))
    assert "served by the generic family" in trained.stderr
    resumed = corl("train", "--config", str(path), "train.max_steps=3", "train.resume=true")
    assert "resumed from" in resumed.stderr
    rows = metrics(tmp_path / "run")
    assert sorted((r["step"], r["member"]) for r in rows) == [(s, m) for s in (1, 2, 3) for m in ("g", "peer")]

    checkpoint = tmp_path / "run" / "checkpoints" / "step-3" / "g"
    benchmark = "easyvqa" if vision else "math500"
    corl("eval", "--models", str(checkpoint), "--benchmarks", benchmark, "--limit", "3", "--out", str(tmp_path / "ev"))
    (scores,) = json.loads((tmp_path / "ev" / "results.json").read_text()).values()
    assert scores[benchmark]["n"] >= 3 and len(scores[benchmark]["records"]) == scores[benchmark]["n"]

    plan = corl("plan", "--config", str(path), "--gpus-per-node", "2")
    assert "fits" in plan.stdout

    corl("export", str(tmp_path / "run"), "--out", str(tmp_path / "exported"))
    _reload_and_sample(tmp_path / "exported" / "g", vision)


def _reload_and_sample(path: Path, vision: bool) -> None:
    """The export as a transformers user loads it: Auto classes, the saved chat template, two sampled tokens."""
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path)
    templater = (transformers.AutoProcessor if vision else transformers.AutoTokenizer).from_pretrained(path)
    content = [{"type": "image"}, {"type": "text", "text": "What shape?"}] if vision else "What is 2+2?"
    text = templater.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    if vision:
        from PIL import Image

        inputs = templater(text=[text], images=[[Image.new("RGB", (64, 64), "red")]], return_tensors="pt")
    else:
        inputs = templater([text], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert inputs["input_ids"].shape[1] < out.shape[1] <= inputs["input_ids"].shape[1] + 2


@pytest.mark.parametrize("arch", ["llava_onevision", "olmo2"])
def test_a_generic_lora_member_trains_adapters_resumes_evaluates_and_exports_merged(tiny_zoo, tmp_path, arch):
    """LoRA on a generic member as a user runs it: the default target modules found on its language model, a
    PEFT adapter checkpointed per step, a resume, `corl eval` on the adapter checkpoint, `corl export --merge`,
    and the merged model reloaded with plain transformers, its weights moved from the base's."""
    vision = arch in GENERIC_VISION
    corl("zoo", "--arch", arch, "--out", str(tmp_path / arch))
    peer = tiny_zoo["qwen2_vl" if vision else "qwen3"]
    config = {
        "output_dir": str(tmp_path / "run"),
        "members": [
            {"id": "g", "model": str(tmp_path / arch), "lora": {"r": 4}},
            {"id": "peer", "model": str(peer)},
        ],
        "data": {
            "train": {"loader": "easyvqa", "limit": 32} if vision else {"loader": "math500", "split": "test"},
            "batch_size": 2,
        },
        "rollout": {"n": 2, "max_new_tokens": 6},
        "reward": {"mode": "entropy"},  # every response rewarded apart: the adapters get a gradient each step
        "train": {"max_steps": 2, "lr": 1e-2, "save_every": 1, "warmup_ratio": 0.0},
        "logging": {"report_to": [], "progress": False},
    }
    path = tmp_path / "cohort.yaml"
    path.write_text(yaml.safe_dump(config))
    corl("train", "--config", str(path))
    corl("train", "--config", str(path), "train.max_steps=3", "train.resume=true")
    checkpoint = tmp_path / "run" / "checkpoints" / "step-3" / "g"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    targets = json.loads((checkpoint / "adapter_config.json").read_text())["target_modules"]
    assert targets and all("vision" not in t and "visual" not in t for t in targets)

    benchmark = "easyvqa" if vision else "math500"
    corl("eval", "--models", str(checkpoint), "--benchmarks", benchmark, "--limit", "3", "--out", str(tmp_path / "ev"))
    corl("export", str(tmp_path / "run"), "--out", str(tmp_path / "exported"), "--merge")
    _reload_and_sample(tmp_path / "exported" / "g", vision)
    merged, base = (load_file(p / "model.safetensors") for p in (tmp_path / "exported" / "g", tmp_path / arch))
    moved = [k for k in base if k in merged and not torch.equal(merged[k], base[k])]
    assert moved and all("vision" not in k and "visual" not in k for k in moved), moved

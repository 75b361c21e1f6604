"""One precision for every member kind: DeepSpeed members compute like plain ones (fp32 masters and Adam state,
forward passes under bf16 autocast when train.mixed_precision resolves to bf16), through the `torch_autocast`
section the trainer writes into DeepSpeed's config. On a GPU DeepSpeed 0.19 switched off the autocast we opened
outside its engine ("torch.autocast is enabled outside DeepSpeed but disabled within the DeepSpeed engine"), so
ZeRO members computed in fp32. The decisions are checked here on a CPU with mixed_precision=bf16 set explicitly
(its default keeps the tiny models' fp32 on a CPU); what a GPU run logs, bench/gpu_check.sh sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_corl.members.deepspeed_update import DeepSpeedConfigError, load_deepspeed_config
from vlm_corl.members.precision import update_autocast_dtype

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs" / "deepspeed").glob("*.json"))
BF16 = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
OFF = {"enabled": False}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "mixed_precision, device, section",
    [("bf16", "cpu", BF16), ("bf16", "cuda", BF16), ("no", "cuda", OFF), ("auto", "cuda", BF16), ("auto", "cpu", OFF)],
)
def test_the_deepspeed_config_carries_the_runs_autocast_and_keeps_fp32_masters(path, mixed_precision, device, section):
    """train.mixed_precision, resolved for the member's device as for a plain member, becomes DeepSpeed's
    `torch_autocast` section; DeepSpeed reads it so (no bf16/fp16 weights, no bf16 gradient transfers)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    autocast = update_autocast_dtype(mixed_precision, torch.device(device))
    cfg = load_deepspeed_config(path, grad_clip=1.0, group_size=1, autocast=autocast)
    assert cfg["torch_autocast"] == section
    read = DeepSpeedConfig(cfg)
    assert read.torch_autocast_enabled is section["enabled"]
    if section["enabled"]:
        assert read.torch_autocast_dtype == torch.bfloat16
        assert read.torch_autocast_lower_precision_safe_modules == []  # gradients reduced in fp32
    assert not read.bfloat16_config.enabled and not read.float16_config.enabled  # fp32 master weights


@pytest.mark.parametrize(
    "section, key",
    [
        ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "torch_autocast"),
        ({"torch_autocast": {"enabled": False}}, "torch_autocast"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bfloat16"),
        ({"fp16": {"enabled": "auto"}}, "fp16"),
    ],
)
def test_a_precision_section_in_the_users_json_is_refused_naming_the_file_and_key(tmp_path, section, key):
    """The run has one stated precision, train.mixed_precision: a JSON that sets its own is refused, not merged."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **section}))
    with pytest.raises(DeepSpeedConfigError) as err:
        load_deepspeed_config(path, grad_clip=1.0, group_size=1, autocast=torch.bfloat16)
    message = str(err.value)
    assert message.startswith(f"{path}: remove the {key!r} section") and "train.mixed_precision" in message


def test_a_disabled_half_precision_section_is_accepted(tmp_path):
    """Templates often carry `"bf16": {"enabled": false}`: it changes nothing, so it is no conflict."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}))
    assert load_deepspeed_config(path, grad_clip=1.0, group_size=1, autocast=torch.bfloat16)["torch_autocast"] == BF16


@pytest.fixture(scope="module")
def computed(tiny_zoo, tmp_path_factory) -> dict:
    """tests/deepspeed_precision_worker.py's findings: ZeRO-2 under bf16 and `no`, ZeRO-3 under bf16."""
    out = tmp_path_factory.mktemp("precision")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "deepspeed_precision_worker.py"), str(tiny_zoo["qwen2_vl"]), str(out)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("member", ["zero2_bf16", "zero3_bf16"])
def test_deepspeed_members_compute_in_bf16_under_deepspeeds_autocast_with_fp32_masters(computed, member):
    """mixed_precision=bf16: every Linear layer's output is bf16 and so are the logits the loss sees, with no
    autocast of ours open around the engine (DeepSpeed's own does it, so it has nothing to switch off or warn
    about); weights, ZeRO's partitions and Adam's moments stay fp32, gradients are reduced in fp32."""
    got = computed[member]
    assert got["linear_outputs"] == ["torch.bfloat16"] and got["compute_dtype"] == "bfloat16"
    assert got["outer_autocast_at_engine"] == [False]
    assert got["weights"] == got["masters"] == got["adam"] == got["gradient_buckets"] == ["torch.float32"]
    assert got["loss_finite"] and got["updated"]


def test_a_deepspeed_member_without_mixed_precision_computes_in_fp32(computed):
    got = computed["zero2_no"]
    assert got["linear_outputs"] == ["torch.float32"] and got["compute_dtype"] == "float32"
    assert got["loss_finite"] and got["updated"]

"""The speed fields of metrics.jsonl (vlm_corl.training.monitor.throughput): tokens per second of the rollout and the
update on every device, the update's MFU against the card's bf16 peak on CUDA only, the GPU's busy share per
phase from nvidia-smi's samples."""

from __future__ import annotations

import threading

import pytest
from cohort_helpers import cohort, metrics

from vlm_corl.config import config_from_dict
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.monitor.throughput import BusySampler, Throughput, model_flops, peak_bf16_flops


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("NVIDIA H200", ("H200", 989e12)),
        ("NVIDIA H100 80GB HBM3", ("H100", 989e12)),
        ("NVIDIA GH200 480GB", ("GH200", 989e12)),
        ("NVIDIA A100-SXM4-80GB", ("A100", 312e12)),
        ("NVIDIA L40S", ("L40S", 362e12)),
        ("NVIDIA L4", ("L4", 121e12)),
        ("Tesla T4", None),
    ],
)
def test_the_peak_is_the_cards_bf16_dense_peak_by_name(device, expected):
    assert peak_bf16_flops(device) == expected


@pytest.mark.parametrize(
    ("device", "expected"),
    [  # torch.cuda.get_device_name's names of parts whose dense bf16 peaks differ from their family's first entry
        ("NVIDIA H100 PCIe", ("H100 PCIe", 756e12)),
        ("NVIDIA H100 NVL", ("H100 NVL", 835e12)),
        ("NVIDIA H100 80GB HBM3", ("H100", 989e12)),
        ("NVIDIA H200 NVL", ("H200 NVL", 835e12)),
        ("NVIDIA H200", ("H200", 989e12)),
        ("NVIDIA GB200", ("GB200", 2.5e15)),
        ("NVIDIA B200", ("B200", 2.25e15)),
        ("NVIDIA H800 PCIe", ("H800 PCIe", 756e12)),
    ],
)
def test_each_part_gets_its_own_peak_the_most_specific_name_first(device, expected):
    """The table lists each family's SXM part before its variants (and B200 before GB200): a lookup taking the
    first name the device's contains would give the PCIe, NVL and GB200 parts another card's peak."""
    assert peak_bf16_flops(device) == expected


def test_model_flops_are_6_per_parameter_and_token_and_4_for_lora():
    assert model_flops(2e9, 1000) == 6 * 2e9 * 1000
    assert model_flops(2e9, 1000, lora=True) == 4 * 2e9 * 1000


def _rows():
    common = {"step": 1, "time_update": 2.0, "time_rollout": 4.0}
    return [
        {**common, "member": "a", "tokens_per_s": 100.0, "update_tokens": 4000},
        {**common, "member": "b", "tokens_per_s": 50.0, "update_tokens": 1000},
        {**common, "member": "a_teacher", "tokens_per_s": 80.0, "update_tokens": None},
    ]


def test_update_mfu_is_every_members_model_flops_over_the_phase_and_the_peak():
    speed = Throughput({"a": (1e9, False), "b": (2e9, True)}, peak=1e15, devices=2)
    rows = speed.fields(_rows())
    flops = 6 * 1e9 * 4000 + 4 * 2e9 * 1000
    assert [r["update_mfu"] for r in rows] == [round(flops / 2.0 / 2e15, 5)] * 3
    assert [r.get("update_tokens_per_s") for r in rows] == [2000.0, 500.0, None]
    assert [r["rollout_tokens_per_s"] for r in rows] == [100.0, 50.0, 80.0]
    assert rows[0]["member"] == "a" and rows[0]["time_update"] == 2.0  # the row's own fields stay


def test_no_mfu_without_a_known_peak():
    rows = Throughput({"a": (1e9, False)}, peak=None).fields(_rows())
    assert all("update_mfu" not in r for r in rows) and rows[0]["update_tokens_per_s"] == 2000.0


def test_the_busy_share_is_averaged_per_phase_the_samples_came_in():
    sampler = object.__new__(BusySampler)  # its nvidia-smi stream is fed by hand
    phases = iter(["rollout", "rollout", "rollout", "update", "update"])
    sampler.phase, sampler.samples, sampler.lock = lambda: next(phases), {}, threading.Lock()
    sampler._read(["20\n", "40\n", "not a number\n", "90\n", "100\n"])
    speed = Throughput({}, None, busy=sampler)
    row = speed.fields(_rows()[:1])[0]
    assert row["gpu_busy_rollout"] == 0.3 and row["gpu_busy_update"] == 0.95
    assert "gpu_busy_rollout" not in speed.fields(_rows()[:1])[0]  # each step's samples once


def test_the_busy_share_goes_only_on_the_rows_of_the_slots_the_sampled_gpu_hosts():
    """Members a and b on ranks 0 and 1 (an even split of 2 processes): rank 0's sampler saw its own GPU only,
    so b's rows (on rank 1's GPU) get no gpu_busy field; a's do."""
    from vlm_corl.config.schema import MemberConfig
    from vlm_corl.distributed.world import place_members
    from vlm_corl.training.monitor.throughput import hosted_slots
    from vlm_corl.training.run.slots import slot_specs

    members = [MemberConfig(id="a", model="m"), MemberConfig(id="b", model="m")]
    sampled = hosted_slots(place_members(members, 2), slot_specs(members, "members"), rank=0)
    assert sampled == {"a"}
    sampler = object.__new__(BusySampler)
    sampler.samples, sampler.lock = {"update": [0.5]}, threading.Lock()
    rows = Throughput({}, None, busy=sampler, sampled=sampled).fields(_rows()[:2])
    assert rows[0]["gpu_busy_update"] == 0.5 and "gpu_busy_update" not in rows[1]


def test_stopping_the_busy_sampler_kills_an_nvidia_smi_that_ignores_termination():
    """A query stuck past SIGTERM (nvidia-smi in the driver after an Xid, here a process ignoring it) is killed
    after the timeout: stop returns in seconds, not when the process chooses to end."""
    import subprocess
    import sys
    import time

    stuck = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    sampler = object.__new__(BusySampler)
    sampler.proc = subprocess.Popen([sys.executable, "-c", stuck], stdout=subprocess.PIPE, text=True)
    try:
        assert sampler.proc.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
        start = time.perf_counter()
        stopper = threading.Thread(target=sampler.stop, kwargs={"timeout_s": 0.5}, daemon=True)
        stopper.start()
        stopper.join(15)
        assert not stopper.is_alive() and time.perf_counter() - start < 15
        assert sampler.proc.poll() is not None  # ended (killed), not left running
    finally:
        sampler.proc.kill()
        sampler.proc.wait()


def test_a_cpu_run_logs_tokens_per_second_and_no_mfu(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward={"mode": "self_certainty"})
    run_cohort(config_from_dict(cfg))
    rows = metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        assert r["rollout_tokens_per_s"] == r["tokens_per_s"] > 0
        assert r["update_tokens_per_s"] == pytest.approx(r["update_tokens"] / r["time_update"])
        assert "update_mfu" not in r and not any(k.startswith("gpu_busy_") for k in r)

"""The cohort as one multi-process job (torchrun / accelerate launch, CPU and gloo), against the single-process run.

- 2 processes / 2 members and 3 processes / 3 members (ring): metrics and weights bit-identical to 1 process;
- 4 processes / 2 members (2 data-parallel ranks each): each member's ranks hold identical weights, and the
  run matches the 1-process one (weights within 1e-6, every metric but timings equal);
- `accelerate launch` with configs/accelerate/cpu_2proc.yaml (the README command): one row per member and
  step, a checkpoint that `from_pretrained` loads;
- a rank killed mid-step: the job exits non-zero naming the member, no incomplete checkpoint counts, and a
  resume finishes the run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from cohort_helpers import cohort, easyvqa_cohort, metrics, trained_fields, weights

from vlm_corl.training.run.checkpoint import is_complete, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}


_config = easyvqa_cohort


def _launch(cfg: Path, procs: int, *overrides: str, wait: bool = True):
    cmd = [sys.executable, "-m", "vlm_corl.train", "--config", str(cfg), *overrides]
    if procs > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "-m", "vlm_corl.train"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )  # its own process group: a test can kill launcher + workers
    if wait:
        err = proc.communicate(timeout=600)[1].decode()
        assert proc.returncode == 0, err[-4000:]
    return proc


def _final(run: Path, ids) -> dict:
    return {m: weights(run / "run" / "checkpoints" / "step-2" / m) for m in ids}


@pytest.fixture(scope="module")
def two_members(base_models):
    return [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]


@pytest.fixture(scope="module")
def single(two_members, tmp_path_factory):
    """The reference: the 2-member cohort in one process."""
    tmp = tmp_path_factory.mktemp("single")
    _launch(_config(tmp, two_members, "one"), 1)
    return tmp / "one"


def test_two_processes_equal_one_process_bit_for_bit(two_members, single, tmp_path):
    _launch(_config(tmp_path, two_members, "two"), 2)
    rows = metrics(tmp_path / "two" / "run")
    assert len(rows) == 4 and {(r["step"], r["member"]) for r in rows} == {
        (s, m) for s in (1, 2) for m in ("qwen", "llama")
    }
    assert any(r["reward_mean"] > 0 for r in rows), "no reward: the comparison proves little"
    assert trained_fields(rows) == trained_fields(metrics(single / "run"))
    one, two = _final(single, ["qwen", "llama"]), _final(tmp_path / "two", ["qwen", "llama"])
    assert all(torch.equal(one[m][k], two[m][k]) for m in one for k in one[m])


@pytest.mark.slow  # `make test-scale` (CI): the default suite keeps two processes equal to one, bit for bit
def test_three_members_on_three_processes_equal_one_process(base_models, tmp_path):
    members = [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"]), ("qwen_b", base_models["qwen2_vl"])]
    _launch(_config(tmp_path, members, "one"), 1)
    _launch(_config(tmp_path, members, "three"), 3)
    assert trained_fields(metrics(tmp_path / "three" / "run")) == trained_fields(metrics(tmp_path / "one" / "run"))
    ids = [m for m, _ in members]
    one, three = _final(tmp_path / "one", ids), _final(tmp_path / "three", ids)
    assert all(torch.equal(one[m][k], three[m][k]) for m in one for k in one[m])


def test_data_parallel_ranks_of_a_member_stay_identical_and_match_one_process(two_members, single, tmp_path):
    _launch(_config(tmp_path, two_members, "four"), 4)
    manifest = json.loads((tmp_path / "four" / "run" / "checkpoints" / "step-2" / "manifest.json").read_text())
    assert manifest["replicas"]["qwen"].keys() == {"0", "1"} and manifest["replicas"]["llama"].keys() == {"2", "3"}
    for by_rank in manifest["replicas"].values():
        assert len(set(by_rank.values())) == 1, by_rank
    # The batch is split, so sums run in another order: equal up to float rounding, not bit for bit.
    four_rows, one_rows = trained_fields(metrics(tmp_path / "four" / "run")), trained_fields(metrics(single / "run"))
    assert len(four_rows) == len(one_rows)
    for a, b in zip(four_rows, one_rows):
        assert a.keys() == b.keys()
        for k in a:
            close = isinstance(a[k], float) and b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7)
            assert close or a[k] == b[k], (k, a[k], b[k])
    one, four = _final(single, ["qwen", "llama"]), _final(tmp_path / "four", ["qwen", "llama"])
    worst = max((one[m][k] - four[m][k]).abs().max().item() for m in one for k in one[m])
    assert worst < 1e-6, worst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_launch_two_processes_writes_rows_and_a_loadable_checkpoint(two_members, tmp_path):
    from transformers import AutoModelForImageTextToText

    cfg = _config(tmp_path, two_members, "acc")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
            "--main_process_port",  # a free port: another test may run a launch beside this one (pytest -n)
            str(_free_port()),
            "-m",
            "vlm_corl.train",
            "--config",
            str(cfg),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 0: qwen; rank 1: llama" in proc.stderr
    rows = metrics(tmp_path / "acc" / "run")
    assert sorted((r["step"], r["member"]) for r in rows) == [(1, "llama"), (1, "qwen"), (2, "llama"), (2, "qwen")]
    for m in ("qwen", "llama"):
        model = AutoModelForImageTextToText.from_pretrained(tmp_path / "acc" / "run" / "checkpoints" / "step-2" / m)
        assert sum(p.numel() for p in model.parameters()) > 0


def test_a_killed_rank_stops_the_job_naming_its_member_and_the_run_resumes(two_members, tmp_path):
    cfg = _config(tmp_path, two_members, "kill", save_every=2, keep_last=5)
    proc = _launch(cfg, 2, "train.max_steps=40", "train.dist_timeout_s=60", wait=False)
    ckpts = tmp_path / "kill" / "run" / "checkpoints"
    deadline = time.time() + 300
    while not (ckpts / "step-2").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # into a later step
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    killed_at = time.time()
    os.kill(int(max(workers, key=int)), signal.SIGKILL)  # the second worker: rank 1, member llama
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode != 0
    assert time.time() - killed_at < 60, "the job outlived its collective timeout"
    assert "rank 1 (llama)" in err, err[-3000:]
    assert "train.resume=true" in err
    done = list_checkpoints(tmp_path / "kill" / "run")
    assert done and all(is_complete(c) for c in done)
    last = int(done[-1].name.split("-")[1])
    assert last < 40, "the run finished before it was killed: the test proves nothing"
    _launch(cfg, 2, "train.max_steps=" + str(last + 2), "train.resume=true")
    rows = metrics(tmp_path / "kill" / "run")
    assert [r["step"] for r in rows if r["member"] == "qwen"] == list(range(1, last + 3))


def test_scale_benchmark_runs_at_its_smallest_size():
    proc = subprocess.run(
        [sys.executable, "bench/scale.py", "--size", "smoke", "--rounds", "1"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["one_process_step_s"] > 0 and out["two_process_step_s"] > 0
    assert out["ratio_two_vs_one"] == pytest.approx(out["two_process_step_s"] / out["one_process_step_s"], rel=0.01)
    assert {"rollout", "update", "exchange"} <= out["phase_median_s"]["2p"].keys()


# slow (about 2 min each on 2 cores): `make test-scale`, which CI runs after `make test`; ZeRO-3's partitioned
# member stays in the default suite through tests/test_zero3_stream.py
@pytest.mark.parametrize(
    "stage", [pytest.param("zero2", marks=pytest.mark.slow), pytest.param("zero3", marks=pytest.mark.slow)]
)
def test_deepspeed_members_on_rank_groups_match_one_process_and_resume_exactly(two_members, single, tmp_path, stage):
    """4 processes, 2 members x 2 ranks, each member its own DeepSpeed engine over its group: after 2 steps
    the weights match the single-process run; a run killed after its step-2 checkpoint and resumed ends
    with exactly the weights of an uninterrupted 4-step run; saved members load with from_pretrained."""
    from transformers import AutoModelForImageTextToText

    ds = f"train.deepspeed={ROOT / 'configs' / 'deepspeed' / (stage + '.json')}"
    # micro-batches of 2: several per rank and step, uneven across ranks (zero-advantage ones are skipped)
    cfg = _config(tmp_path, two_members, "ds", save_every=2, keep_last=5, micro_batch_size=2)
    _launch(cfg, 4, ds)
    run = tmp_path / "ds" / "run"
    state_files = {p.name for p in (run / "checkpoints" / "step-2" / "qwen").iterdir()}
    assert {"deepspeed_state.0.pt", "deepspeed_state.1.pt", "model.safetensors"} <= state_files
    one, four = _final(single, ["qwen", "llama"]), _final(tmp_path / "ds", ["qwen", "llama"])
    worst = max((one[m][k] - four[m][k]).abs().max().item() for m in one for k in one[m])
    assert worst < 1e-4, worst  # gradients summed in another order, then two Adam steps at lr 1e-3
    AutoModelForImageTextToText.from_pretrained(run / "checkpoints" / "step-2" / "llama")

    _launch(cfg, 4, ds, "train.max_steps=4", "output_dir=" + str(tmp_path / "full"))
    proc = _launch(cfg, 4, ds, "train.max_steps=4", "output_dir=" + str(tmp_path / "cut"), wait=False)
    deadline = time.time() + 300
    while not (tmp_path / "cut" / "checkpoints" / "step-2").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers, at once
    proc.communicate(timeout=120)
    assert not (tmp_path / "cut" / "checkpoints" / "step-4").exists(), "finished before the kill: proves nothing"
    _launch(cfg, 4, ds, "train.max_steps=4", "output_dir=" + str(tmp_path / "cut"), "train.resume=true")
    for m in ("qwen", "llama"):
        a = weights(tmp_path / "full" / "checkpoints" / "step-4" / m)
        b = weights(tmp_path / "cut" / "checkpoints" / "step-4" / m)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{m}: weights differ after resume"


@pytest.mark.slow  # about 1 min on 2 cores: `make test-scale`
def test_the_zero3_offload_recipe_trains_two_families_in_one_process_and_resumes(tiny_zoo, tmp_path):
    """Review R3-4: configs/deepspeed/zero3_offload.json, what configs/cohorts/gpu_1gpu_2vlm.yaml trains with. Two
    members of two families hosted in one process, each a ZeRO-3 engine with its weights and optimizer state
    offloaded to the host and a full copy for its HF rollouts, computing in bf16 as on a GPU (DeepSpeed's
    autocast), on a dense reward: 2 steps and a checkpoint, then a resume that continues at step 3."""
    members = {"qwen": tiny_zoo["qwen2_vl"], "intern": tiny_zoo["internvl"]}
    cfg = cohort(tmp_path, list(members.items()), reward={"mode": "self_certainty"})
    offload = ROOT / "configs" / "deepspeed" / "zero3_offload.json"
    cfg["train"].update(save_every=2, deepspeed=str(offload), mixed_precision="bf16")
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"

    def steps_and_losses() -> tuple[list, bool]:
        rows = metrics(run)
        return sorted((r["step"], r["member"]) for r in rows), all(math.isfinite(r["loss"]) for r in rows)

    _launch(path, 1)
    assert steps_and_losses() == ([(s, m) for s in (1, 2) for m in sorted(members)], True)
    for m, model in members.items():
        first, saved = weights(model), weights(run / "checkpoints" / "step-2" / m)
        assert first.keys() == saved.keys() and any(not torch.equal(first[k], saved[k]) for k in first), m
        assert (run / "checkpoints" / "step-2" / m / "deepspeed_state.0.pt").is_file()
    _launch(path, 1, "train.max_steps=3", "train.resume=true")
    assert steps_and_losses() == ([(s, m) for s in (1, 2, 3) for m in sorted(members)], True)
    assert is_complete(run / "checkpoints" / "step-3")


def test_a_launch_the_members_cannot_be_placed_on_exits_2_with_the_fix(two_members, tmp_path):
    """3 processes for 2 members: every rank stops before loading anything, with one clear line, exit 2."""
    proc = _launch(_config(tmp_path, two_members, "bad"), 3, wait=False)
    err = proc.communicate(timeout=300)[1].decode()
    assert proc.returncode != 0
    assert "2 members (qwen, llama) cannot be split evenly over 3 processes" in err
    assert "vlm_corl/" not in err, err[-3000:]  # no traceback through our code (torchrun prints its own)
    assert not (tmp_path / "bad" / "run" / "checkpoints").exists()


def test_an_api_script_under_torchrun_gives_the_rows_of_one_process(tiny_zoo, tmp_path):
    """tests/api_script.py (CohortTrainer with a Dataset, a reward function and a callback) launched as
    `torchrun --nproc_per_node 2 script.py` and as `python script.py`: the same metrics rows; each member's
    reward function ran on its own rank, the callback on rank 0 saw both steps."""
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for family in ("qwen2_vl", "mllama"):
        (zoo / family).symlink_to(tiny_zoo[family])
    script = str(ROOT / "tests" / "api_script.py")
    for out, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])):
        result = subprocess.run(
            [sys.executable, *launcher, script, str(zoo), str(tmp_path / out)],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
    key = lambda r: (r["step"], r["member"])  # noqa: E731
    one, two = (sorted(trained_fields(metrics(tmp_path / o / "run")), key=key) for o in ("one", "two"))
    assert [key(r) for r in one] == [(1, "l"), (1, "q"), (2, "l"), (2, "q")] and one == two
    calls = [json.loads((tmp_path / "two" / f"calls-{r}.json").read_text()) for r in (0, 1)]
    assert [{c["member"] for c in part} for part in calls] == [{"q"}, {"l"}] and all(len(p) == 2 for p in calls)
    assert json.loads((tmp_path / "two" / "steps.json").read_text()) == [1, 2]

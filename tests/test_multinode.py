"""Beyond one launcher (issue 57), all slow (`make test-scale`): a job that torchrun restarts itself
(`--max-restarts`), two torchrun launchers on one machine behaving as two nodes (c10d rendezvous on localhost, each
"node" with its own TMPDIR and Hugging Face cache) training a member whose ranks span both, and a lost node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cohort_helpers import easyvqa_cohort, metrics, tests_env, weights

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "vlm_corl.train"]


@pytest.fixture(scope="module")
def two_members(base_models):
    return [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]


def _start(launcher: list[str], *args: str, env: dict | None = None) -> subprocess.Popen:
    """A launch in its own session (a test can kill a launcher and its workers), stderr captured."""
    return subprocess.Popen(
        ["nice", "-n", "5", *TORCHRUN, *launcher, *args], cwd=ROOT, env=env or tests_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    err = proc.communicate(timeout=timeout)[1].decode()
    assert proc.returncode == 0, err[-4000:]
    return err


def _wait_for(path: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.time() + 300
    while not path.exists():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead and time.time() < deadline, dead and dead[0].stderr.read().decode()[-3000:]
        time.sleep(0.05)


def _workers(launcher: subprocess.Popen) -> dict[int, int]:
    """{global rank: pid} of a launcher's workers (read from their environment)."""
    pids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    if len(pids) == 1:  # `nice` exec'd into torchrun: same pid; otherwise the launcher is nice's child
        pids = subprocess.run(["pgrep", "-P", pids[0]], capture_output=True, text=True).stdout.split() or pids
    ranks = {}
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[int(next(v for v in env if v.startswith(b"RANK=")).split(b"=")[1])] = int(pid)
    return ranks


@pytest.mark.slow  # ~10 s: two attempts of two processes, no model
def test_a_group_torchrun_restarts_starts_from_an_empty_store():
    """torchrun's c10d rendezvous keeps one store for the whole job: the restarted group must not read the failed
    group's keys (gloo's peer addresses were among them: 'connectFullMesh ... Connection refused')."""
    proc = _start(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=1"], str(ROOT / "tests/elastic_store_worker.py")
    )
    err = _finish(proc, timeout=300)
    seen = sorted(line for line in err.splitlines() if line.startswith("attempt "))
    assert seen == [f"attempt {a} rank {r} stale False" for a in (0, 1) for r in (0, 1)], err[-3000:]


@pytest.mark.slow
def test_torchrun_max_restarts_continues_a_killed_worker_from_its_checkpoint_exactly(two_members, tmp_path):
    """A worker SIGKILLed mid-step under `--max-restarts 1` with train.resume=auto: torchrun restarts the group,
    which resumes from the last complete checkpoint; no metrics row twice, the weights of an uninterrupted run."""
    cfg = easyvqa_cohort(tmp_path, two_members, "job", save_every=2, keep_last=5, max_steps=6)
    one = ["--standalone", "--nproc_per_node=2"]
    _finish(_start(one, *TRAIN, "--config", str(cfg), f"output_dir={tmp_path / 'full'}"))
    proc = _start([*one, "--max-restarts=1"], *TRAIN, "--config", str(cfg), f"output_dir={tmp_path / 'cut'}",
                  "train.resume=auto")  # fmt: skip
    _wait_for(tmp_path / "cut" / "checkpoints" / "step-2", [proc])
    time.sleep(0.3)  # into step 3
    workers = _workers(proc)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGKILL)
    err = _finish(proc)
    assert "resumed from" in err, "the group was not restarted: the test proves nothing"
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert [(r["step"], r["member"]) for r in cut] == [(r["step"], r["member"]) for r in full]
    for m in ("qwen", "llama"):
        a, b = (weights(tmp_path / run / "checkpoints" / "step-6" / m) for run in ("full", "cut"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"{m}: weights differ after the restart"

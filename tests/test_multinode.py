"""Beyond one launcher (issue 57), all slow (`make test-scale`): a job that torchrun restarts itself
(`--max-restarts`), two torchrun launchers on one machine behaving as two nodes (c10d rendezvous on localhost, each
"node" with its own TMPDIR and Hugging Face cache) training a member whose ranks span both, and a lost node.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cohort_helpers import easyvqa_cohort, metrics, weights
from cohort_helpers import tests_env as launch_env  # not a test: pytest collects names starting with test

from vlm_corl.training.run.checkpoint import is_complete, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "vlm_corl.train"]


@pytest.fixture(scope="module")
def two_members(base_models):
    return [("qwen", base_models["qwen2_vl"]), ("llama", base_models["mllama"])]


def _start(launcher: list[str], *args: str, env: dict | None = None) -> subprocess.Popen:
    """A launch in its own session (a test can kill a launcher and its workers), stderr captured."""
    return subprocess.Popen(
        ["nice", "-n", "5", *TORCHRUN, *launcher, *args], cwd=ROOT, env=env or launch_env(),
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


def _two_nodes(cfg: Path, tmp: Path, port: int, *overrides: str) -> list[subprocess.Popen]:
    """Two torchrun launchers of 2 processes each over a c10d rendezvous on localhost, each "node" with its own
    TMPDIR and Hugging Face cache."""
    procs = []
    for node in (0, 1):
        local = tmp / f"node{node}"
        (local / "tmp").mkdir(parents=True, exist_ok=True)
        env = launch_env(TMPDIR=str(local / "tmp"), HF_HOME=str(local / "hf"))
        launcher = ["--nnodes=2", "--nproc_per_node=2", f"--node_rank={node}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={tmp.name}"]  # fmt: skip
        procs.append(_start(launcher, *TRAIN, "--config", str(cfg), *overrides, env=env))
    return procs


def _spanning(tmp: Path, two_members, name: str, **train) -> Path:
    """qwen on rank 0, llama on ranks 1-3: with 2 processes a node, llama's ranks span both nodes."""
    import yaml

    path = easyvqa_cohort(tmp, two_members, name, **train)
    cfg = yaml.safe_load(path.read_text())
    for member, ranks in zip(cfg["members"], ([0], [1, 2, 3])):
        member["ranks"] = ranks
    path.write_text(yaml.safe_dump(cfg))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_train_a_member_spanning_both_like_one_launcher_and_resume_exactly(two_members, tmp_path):
    """The same weights as one launcher of 4 processes, every metrics row once, complete checkpoints, and a resume
    across the two launchers that ends with the weights of the uninterrupted one-launcher run."""
    # a constant learning rate: the first launch of the two nodes stops at step 2 of the 3 the others run
    cfg = _spanning(tmp_path, two_members, "job", save_every=1, keep_last=5, min_lr_ratio=1.0)
    one = tmp_path / "one"
    _finish(_start(["--standalone", "--nproc_per_node=4"], *TRAIN, "--config", str(cfg), f"output_dir={one}",
                   "train.max_steps=3"))  # fmt: skip
    two = tmp_path / "two"
    for overrides in ([], ["train.max_steps=3", "train.resume=auto"]):
        errs = [_finish(p) for p in _two_nodes(cfg, tmp_path, _free_port(), f"output_dir={two}", *overrides)]
    assert "resumed from" in errs[0] + errs[1]
    assert all((tmp_path / f"node{n}" / "tmp").is_dir() for n in (0, 1))
    rows = [(r["step"], r["member"]) for r in metrics(two)]
    assert rows == [(r["step"], r["member"]) for r in metrics(one)] and len(set(rows)) == len(rows) == 6
    assert [c.name for c in list_checkpoints(two)] == ["step-1", "step-2", "step-3"]
    assert all(is_complete(c) for c in list_checkpoints(two))
    for step in (2, 3):  # step 2 from the first launch of the two nodes, step 3 from their resume
        for m in ("qwen", "llama"):
            a, b = (weights(run / "checkpoints" / f"step-{step}" / m) for run in (one, two))
            worst = max((a[k] - b[k]).abs().max().item() for k in a)
            assert worst < 1e-6, (step, m, worst)  # docs/scaling.md: equal within float rounding


@pytest.mark.slow
def test_a_lost_node_is_reported_by_the_other_within_the_timeout_and_the_job_resumes(two_members, tmp_path):
    """The node serving the launch's store (ranks 0-1: qwen, llama) is lost mid-step (launcher and workers killed):
    the other node's ranks stop within train.dist_timeout_s, naming the lost ranks and members, their step and
    phase, the last complete checkpoint, without C++ frames; both relaunched with train.resume=auto continue."""
    cfg = _spanning(tmp_path, two_members, "job", save_every=2, keep_last=5)
    run = tmp_path / "run"
    nodes = _two_nodes(
        cfg, tmp_path, _free_port(), f"output_dir={run}", "train.max_steps=40", "train.dist_timeout_s=20"
    )
    _wait_for(run / "checkpoints" / "step-2", nodes)
    time.sleep(0.3)
    workers = [_workers(n) for n in nodes]
    lost = next(i for i, w in enumerate(workers) if 0 in w)
    killed_at = time.time()
    for pid in [nodes[lost].pid, *workers[lost].values()]:
        os.kill(pid, signal.SIGKILL)
    err = nodes[1 - lost].communicate(timeout=120)[1].decode()
    assert nodes[1 - lost].returncode != 0
    assert time.time() - killed_at < 20, "the survivors outlived train.dist_timeout_s"
    stops = [line for line in err.splitlines() if line.startswith("error: rank ")]
    assert sorted(line.split()[2] for line in stops) == ["2", "3"], err[-3000:]
    last = list_checkpoints(run)[-1]
    for line in stops:
        assert "rank 0 (qwen); rank 1 (llama)" in line and "is lost" in line, line
        assert f"the last complete checkpoint is {last}" in line and " at step " in line and ", phase " in line
    assert "frame #" not in "\n".join(line for line in err.splitlines() if "vlm_corl" in line or "[rank" in line)
    nodes[lost].communicate(timeout=60)
    step = int(last.name.split("-")[1])
    assert step < 40, "the run finished before the node was lost: the test proves nothing"
    for p in _two_nodes(cfg, tmp_path, _free_port(), f"output_dir={run}", f"train.max_steps={step + 1}",
                        "train.resume=auto"):  # fmt: skip
        _finish(p)
    assert [r["step"] for r in metrics(run) if r["member"] == "qwen"] == list(range(1, step + 2))


FAKE_SRUN = """#!/bin/bash
# srun of a 2-node allocation on one machine: the command once per "node", each with its own TMPDIR and HF_HOME
while [[ $1 == --* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do
    mkdir -p "$NODES/$node/tmp"
    SLURM_NODEID=$node SLURM_PROCID=$node TMPDIR="$NODES/$node/tmp" HF_HOME="$NODES/$node/hf" "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
"""


def _rows_and_checkpoints(run: Path) -> tuple[list, list]:
    return sorted((r["step"], r["member"]) for r in metrics(run)), [c.name for c in list_checkpoints(run)]


@pytest.mark.slow
def test_the_slurm_script_runs_two_nodes_under_a_faked_allocation(two_members, tmp_path):
    """configs/launch/slurm_torchrun.sbatch as sbatch would run it, with `srun` and `scontrol` faked: two nodes of
    2 processes meeting through the rendezvous on the first node, a member spanning both."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")  # `scontrol show hostnames LIST`
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = launch_env(PATH=path, NODES=str(tmp_path / "nodes"), SLURM_JOB_NODELIST="node[1-2]",
                    SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID=tmp_path.name, GPUS_PER_NODE="2",
                    RDZV_PORT=str(_free_port()), MAX_RESTARTS="0")  # fmt: skip
    cfg = _spanning(tmp_path, two_members, "job", save_every=2)
    script = ROOT / "configs" / "launch" / "slurm_torchrun.sbatch"
    proc = subprocess.run(["bash", str(script), str(cfg)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "placement over 4 process(es)" in proc.stderr
    assert _rows_and_checkpoints(tmp_path / "job" / "run") == ([(s, m) for s in (1, 2) for m in ("llama", "qwen")],
                                                              ["step-2"])  # fmt: skip
    assert all((tmp_path / "nodes" / n / "tmp").is_dir() for n in ("0", "1"))


@pytest.mark.slow
def test_the_two_node_accelerate_config_runs_as_two_machines(two_members, tmp_path):
    """configs/launch/accelerate_2node_8gpu.yaml launched twice (--machine_rank 0 and 1) on one machine, with the
    address, port and process count a CPU machine needs given on the command line."""
    port, procs = str(_free_port()), []
    cfg = _spanning(tmp_path, two_members, "job")
    for node in (0, 1):
        (tmp_path / f"node{node}" / "tmp").mkdir(parents=True)
        env = launch_env(TMPDIR=str(tmp_path / f"node{node}" / "tmp"), HF_HOME=str(tmp_path / f"node{node}" / "hf"))
        line = ["-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "configs" / "launch" / "accelerate_2node_8gpu.yaml"), "--machine_rank", str(node),
                "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--num_processes", "4",
                *TRAIN, "--config", str(cfg)]  # fmt: skip
        procs.append(subprocess.Popen(["nice", "-n", "5", sys.executable, *line], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))  # fmt: skip
    for proc in procs:
        _finish(proc)
    assert _rows_and_checkpoints(tmp_path / "job" / "run")[0] == [(s, m) for s in (1, 2) for m in ("llama", "qwen")]


@pytest.mark.slow
def test_the_launchers_own_death_is_reported_by_its_workers_without_cpp_frames(two_members, tmp_path):
    """torchrun itself SIGKILLed (its workers live on, their store gone): each worker stops at its next phase with
    the report naming the lost store's node and the last complete checkpoint; not one page of C++ frames."""
    cfg = easyvqa_cohort(tmp_path, two_members, "job", save_every=2, max_steps=40, dist_timeout_s=20)
    proc = _start(["--standalone", "--nproc_per_node=2"], *TRAIN, "--config", str(cfg))
    run = tmp_path / "job" / "run"
    _wait_for(run / "checkpoints" / "step-2", [proc])
    assert len(_workers(proc)) == 2
    os.kill(proc.pid, signal.SIGKILL)  # `nice` exec'd torchrun: the launcher alone
    err = proc.communicate(timeout=120)[1].decode()  # the workers hold the pipe until they stop
    stops = [line for line in err.splitlines() if line.startswith("error: rank ")]
    assert len(stops) == 2 and all("no longer answers" in line for line in stops), err[-3000:]
    assert f"the last complete checkpoint is {list_checkpoints(run)[-1]}" in stops[0]
    assert "frame #" not in err and "Traceback" not in err, err[-3000:]

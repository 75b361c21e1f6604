"""Checkpoints written in the background (`train.async_checkpoint`, vlm_corl.training.run.async_checkpoint).

- when the background write is on (auto: CUDA without DeepSpeed);
- a background checkpoint holds the same files and tensors as one written at the step, old ones pruned alike;
- a full disk during a background write is named, the partial checkpoint removed, the previous one kept;
- a process SIGKILLed during a background write resumes from the previous checkpoint, bit-identical to a run
  never killed;
- two processes (torchrun, gloo), each writing its member in the background, give the checkpoints and rows of one
  process writing at the step.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from cohort_helpers import cohort, metrics, tests_env, trained_fields, weights

from vlm_corl.commands.train import main
from vlm_corl.config import config_from_dict
from vlm_corl.config.schema import resolve_async
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.run.checkpoint import latest_checkpoint, load_cohort_state

ROOT = Path(__file__).resolve().parents[1]
REWARD = {"mode": "none", "custom": "reward_fixtures:shorter_is_better"}  # a tiny random member gets gradients


def test_when_checkpoints_are_written_in_the_background():
    assert resolve_async("auto", "cuda", deepspeed=False) is True
    assert resolve_async("auto", "cpu", deepspeed=False) is False  # the host copy costs about the write there
    assert resolve_async(True, "cpu", deepspeed=False) is True
    assert resolve_async(False, "cuda", deepspeed=False) is False
    assert resolve_async("auto", "cuda", deepspeed=True) is False  # DeepSpeed's engine writes its partitions
    assert resolve_async(True, "cuda", deepspeed=True) is False
    from vlm_corl.config.schema import TrainConfig

    assert TrainConfig().async_checkpoint == "auto"


def _trainer_state(directory: Path) -> dict:
    return torch.load(directory / "trainer_state.pt", weights_only=True)


def test_a_background_checkpoint_holds_what_one_written_at_the_step_holds(tiny_zoo, tmp_path, monkeypatch):
    members = [("qwen", tiny_zoo["qwen2_vl"]), ("llama", tiny_zoo["mllama"])]
    real_save, writers = torch.save, set()

    def save(obj, f, *args, **kwargs):
        writers.add(threading.current_thread().name)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    runs = {}
    for background in (False, True):
        writers.clear()
        cfg = cohort(tmp_path / str(background), members, reward=REWARD)
        cfg["train"].update(max_steps=4, save_every=1, keep_last=2, async_checkpoint=background)
        summary = run_cohort(config_from_dict(cfg))
        runs[background] = Path(cfg["output_dir"])
        assert summary["checkpoint"] == str(runs[background] / "checkpoints" / "step-4")
        # the trainer states of steps 1-4 were written by the background thread, and only there
        expected = {"MainThread"} | ({f"checkpoint-{s}" for s in range(1, 5)} if background else set())
        assert writers == expected
    sync, background = runs[False], runs[True]
    # pruned alike once the new one was complete; no temporary directory left behind
    assert sorted(p.name for p in (background / "checkpoints").iterdir()) == ["step-3", "step-4"]
    assert sorted(p.name for p in (sync / "checkpoints").iterdir()) == ["step-3", "step-4"]
    for step in (3, 4):
        a, b = sync / "checkpoints" / f"step-{step}", background / "checkpoints" / f"step-{step}"
        assert sorted(p.relative_to(a) for p in a.rglob("*")) == sorted(p.relative_to(b) for p in b.rglob("*"))
        for mid, _ in members:
            wa, wb = weights(a / mid), weights(b / mid)
            assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), mid
            sa, sb = _trainer_state(a / mid), _trainer_state(b / mid)
            assert sa["scheduler"] == sb["scheduler"] and sa["scheduler"]["last_epoch"] == step
            for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True):
                assert all(torch.equal(pa[k], pb[k]) for k in pa)
        ca, cb = load_cohort_state(a), load_cohort_state(b)
        assert ca["step"] == cb["step"] == step and ca["sampler"] == cb["sampler"]
        assert trained_fields(ca["rows"]) == trained_fields(cb["rows"])
        assert torch.equal(ca["rng"][0]["torch"], cb["rng"][0]["torch"])
    assert trained_fields(metrics(sync)) == trained_fields(metrics(background))


def test_a_full_disk_during_a_background_write_keeps_the_previous_checkpoint(tiny_zoo, tmp_path, capsys):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward=REWARD)
    cfg["train"].update(max_steps=3, save_every=1, async_checkpoint=True)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    real_save, threads = torch.save, []

    def save(obj, f, *args, **kwargs):
        threads.append(threading.current_thread().name)
        if threading.current_thread().name == "checkpoint-2":  # the second checkpoint's writer meets a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    try:
        code = main(["--config", str(path)])
    finally:
        torch.save = real_save
    err = capsys.readouterr().err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert "checkpoint-1" in threads  # the trainer state was written by the background thread
    assert code == 2, err
    assert f"the disk holding {checkpoints} filled while checkpoint step 2 was written" in err
    assert f"the previous checkpoint {checkpoints / 'step-1'} is intact" in err and "Traceback" not in err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1"]  # the partial one removed
    assert main(["--config", str(path), "train.resume=true"]) == 0, capsys.readouterr().err
    assert latest_checkpoint(tmp_path / "run") == checkpoints / "step-3"


# Run as `python KILLER CONFIG [overrides]`: the trainer, SIGKILLed by itself when the background thread writing
# checkpoint step 4 starts its trainer state (the member's weights already on disk, the checkpoint incomplete).
KILLER = """
import os, runpy, signal, sys, threading
import pytest
import torch
real_save = torch.save
def save(obj, f, *args, **kwargs):
    if threading.current_thread().name == "checkpoint-4":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.argv = ["vlm_corl.train", "--config", *sys.argv[1:]]
runpy.run_module("vlm_corl.train", run_name="__main__", alter_sys=True)
"""


def test_a_kill_during_a_background_write_resumes_from_the_previous_checkpoint(tiny_zoo, tmp_path):
    members = [("qwen", tiny_zoo["qwen2_vl"])]
    env = tests_env()
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)

    def config(run: Path) -> str:
        cfg = cohort(run, members, reward=REWARD)
        cfg["train"].update(max_steps=6, save_every=2, keep_last=5, async_checkpoint=True)
        path = run.with_suffix(".yaml")
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    def train(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    full, killed = tmp_path / "full", tmp_path / "killed"
    done = train("-m", "vlm_corl.train", "--config", config(full))
    assert done.returncode == 0, done.stderr[-3000:]
    died = train(str(killer), config(killed))
    assert died.returncode == -9, died.stderr[-3000:]
    checkpoints = killed / "run" / "checkpoints"
    # killed inside the write of step 4: its member's weights are on disk, the checkpoint is not complete
    assert (checkpoints / ".tmp-step-4" / "qwen" / "model.safetensors").is_file()
    assert not (checkpoints / ".tmp-step-4" / "qwen" / "trainer_state.pt").exists()
    assert not (checkpoints / "step-4").exists()
    assert latest_checkpoint(killed / "run") == checkpoints / "step-2"
    resumed = train("-m", "vlm_corl.train", "--config", config(killed), "train.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4", "step-6"]

    a, b = full / "run" / "checkpoints" / "step-6" / "qwen", checkpoints / "step-6" / "qwen"
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "weights differ after the resume"
    sa, sb = _trainer_state(a), _trainer_state(b)
    assert sa["scheduler"] == sb["scheduler"]
    for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert trained_fields(metrics(full / "run")) == trained_fields(metrics(killed / "run"))


def test_host_copies_do_not_follow_the_live_tensors():
    """The snapshot is a copy: an optimizer's in-place update after it leaves it as it was."""
    from vlm_corl.members.state_files import host_copy

    live = {"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(1.0)}}, "groups": [(1, 2)]}
    copied = host_copy(live)
    live["state"][0]["exp_avg"].add_(1)
    assert torch.equal(copied["state"][0]["exp_avg"], torch.ones(3)) and copied["groups"] == [(1, 2)]


def test_two_processes_write_in_the_background_what_one_writes_at_the_step(tiny_zoo, tmp_path):
    """Each rank writes its member in its own thread; the checkpoint is made complete by every rank together
    (the end-of-step poll, the next save, the run's end): the same checkpoints and rows as one process writing
    at the step."""
    members = [("qwen", tiny_zoo["qwen2_vl"]), ("llama", tiny_zoo["mllama"])]
    env = tests_env()
    runs = {}
    for name, procs, background in (("one", 1, False), ("two", 2, True)):
        cfg = cohort(tmp_path / name, members, reward=REWARD)
        cfg["train"].update(max_steps=3, save_every=1, keep_last=2, async_checkpoint=background)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] if procs > 1 else []
        done = subprocess.run(
            [sys.executable, *launcher, "-m", "vlm_corl.train", "--config", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        runs[name] = Path(cfg["output_dir"])
    one, two = runs["one"], runs["two"]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-2", "step-3"]
    assert trained_fields(metrics(one)) == trained_fields(metrics(two))
    for mid, _ in members:
        wa, wb = weights(one / "checkpoints" / "step-3" / mid), weights(two / "checkpoints" / "step-3" / mid)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), mid
        sa, sb = (
            _trainer_state(one / "checkpoints" / "step-3" / mid),
            _trainer_state(two / "checkpoints" / "step-3" / mid),
        )
        for pa, pb in zip(sa["optimizer"]["state"].values(), sb["optimizer"]["state"].values(), strict=True):
            assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert len(load_cohort_state(two / "checkpoints" / "step-3")["rng"]) == 2  # both ranks' RNG states


def test_two_overlapping_saves_of_one_module_leave_it_untouched(tmp_path, monkeypatch):
    """R4-4: a background checkpoint's thread is still saving a member when `keep_best` saves the same module
    from the main thread. Each save sets its own `should_save_on_this_rank` (never the live module's, which both
    used to set and delete: the second delete raised AttributeError), and save_pretrained's writes of dtype and
    architectures go to a copy of the config, not the trainer's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlm_corl.members.member import _write_model

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, dtype="bfloat16")  # fmt: skip
    model = Qwen2ForCausalLM(cfg)  # fp32 weights under a bf16 config: a save would record float32 in it
    inside, main_done, errors = threading.Event(), threading.Event(), {}
    real = Qwen2ForCausalLM.save_pretrained

    def save_pretrained(self, *args, **kwargs):
        if threading.current_thread().name == "checkpoint-50":  # the big member's write: still going on
            inside.set()
            assert main_done.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Qwen2ForCausalLM, "save_pretrained", save_pretrained)

    def background() -> None:
        try:
            _write_model(model, tmp_path / "checkpoint", None, torch.bfloat16)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors["background"] = repr(err)

    thread = threading.Thread(target=background, name="checkpoint-50")
    thread.start()
    assert inside.wait(30)
    try:
        _write_model(model, tmp_path / "best", None, torch.bfloat16)  # keep_best's save_best, meanwhile
    except BaseException as err:  # noqa: BLE001
        errors["main"] = repr(err)
    finally:
        main_done.set()
        thread.join()
    assert errors == {}
    assert "should_save_on_this_rank" not in vars(model)
    assert model.config.dtype == torch.bfloat16 and model.config.architectures is None
    for directory in ("checkpoint", "best"):
        saved = weights(tmp_path / directory)
        assert saved and all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)
        assert json.loads((tmp_path / directory / "config.json").read_text())["dtype"] == "bfloat16"


def test_keep_best_waits_for_the_background_write_of_the_same_member(tiny_zoo, tmp_path, monkeypatch):
    """R4-4 in a run: checkpoints in the background at every step, an evaluation at every step whose member always
    improves, and a writer slowed until the evaluation of its step is over (plus up to a second for keep_best's
    save to start). The run completes; the saves of one module never overlap (keep_best waits for the pending
    write); the last checkpoint and the best model are complete and load."""
    from transformers import AutoConfig, PreTrainedModel

    from vlm_corl.training.phases import eval_phase

    evaluated = {step: threading.Event() for step in range(3)}
    best_saving, saves, inside = threading.Event(), [], []
    real_save, real_evaluate = PreTrainedModel.save_pretrained, eval_phase.evaluate_cohort

    def evaluate_cohort(run, eval_cfg, step):
        rows = real_evaluate(run, eval_cfg, step)
        evaluated[step].set()
        return rows

    def save_pretrained(self, *args, **kwargs):
        name = threading.current_thread().name
        inside.append(name)
        saves.append((name, len(inside)))  # how many saves were going on at once
        if name == "MainThread":
            best_saving.set()
        elif evaluated[int(name.split("-")[1])].wait(60):
            best_saving.wait(1)  # without the wait, keep_best's save starts while this one goes on
        try:
            return real_save(self, *args, **kwargs)
        finally:
            inside.remove(name)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    monkeypatch.setattr(eval_phase, "evaluate_cohort", evaluate_cohort)
    monkeypatch.setattr(eval_phase, "improved", lambda rows, name, best: [r for r in rows if r["benchmark"] == name])
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"])], reward=REWARD)
    cfg["train"].update(max_steps=2, save_every=1, async_checkpoint=True)
    cfg["eval"] = {"benchmarks": ["easyvqa"], "every": 1, "limit": 3, "max_new_tokens": 4, "keep_best": "easyvqa"}
    summary = run_cohort(config_from_dict(cfg))
    run = Path(cfg["output_dir"])
    assert summary["checkpoint"] == str(run / "checkpoints" / "step-2")
    assert {name for name, _ in saves} == {"MainThread", "checkpoint-1", "checkpoint-2"}
    assert max(n for _, n in saves) == 1, saves
    for directory in (run / "checkpoints" / "step-2" / "q", run / "best" / "q"):
        assert weights(directory).keys() == weights(tiny_zoo["qwen2_vl"]).keys()
        assert AutoConfig.from_pretrained(directory).model_type == "qwen2_vl"
    assert json.loads((run / "best" / "best.json").read_text())["q"]["step"] == 2


# Run under torchrun as `python FAILER CONFIG`: rank 1's background writer fails writing checkpoint step 2 (its
# trainer state), while rank 0's writes all succeed.
FAILER = """
import errno, os, runpy, sys, threading
import pytest
import torch
real_save = torch.save
def save(obj, f, *args, **kwargs):
    if os.environ["RANK"] == "1" and threading.current_thread().name == "checkpoint-2":
        raise OSError(errno.EIO, "Input/output error")
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.argv = ["vlm_corl.train", "--config", *sys.argv[1:]]
runpy.run_module("vlm_corl.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_one_rank_failing_its_background_write_stops_every_rank_and_keeps_the_previous_checkpoint(tiny_zoo, tmp_path):
    """Two ranks (torchrun, gloo), each writing its member in the background; rank 1's writer fails on
    checkpoint step 2. Every rank learns it at the same point (the errors are gathered before the checkpoint is
    completed), reports it and exits (none waits forever in a collective the other never joins), and step 1
    stays the latest checkpoint, step 2's partial directory removed."""
    members = [("a", tiny_zoo["qwen2_vl"]), ("b", tiny_zoo["qwen2_vl"])]
    cfg = cohort(tmp_path, members, reward=REWARD)
    cfg["train"].update(max_steps=4, save_every=1, async_checkpoint=True, dist_timeout_s=120)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    failer, logs = tmp_path / "failer.py", tmp_path / "logs"
    failer.write_text(FAILER)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run(
        [*launcher, "--log-dir", str(logs), "--redirects", "3", str(failer), str(path)],
        cwd=ROOT,
        env=tests_env(),
        capture_output=True,
        text=True,
        timeout=400,  # a rank left waiting in a collective would hold the launcher for dist_timeout_s and more
    )
    assert done.returncode != 0
    reports = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(reports) == ["0", "1"], done.stderr[-3000:]
    assert "Input/output error" in reports["1"], reports["1"][-3000:]  # its own error
    assert "rank 1 failed writing checkpoint step 2: OSError: [Errno 5] Input/output error" in reports["0"], reports[
        "0"
    ][-3000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(tmp_path / "run") == checkpoints / "step-1"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1"]

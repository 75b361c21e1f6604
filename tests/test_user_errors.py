"""User mistakes with `python -m vlm_corl.train`: each exits 2 with one message naming the file or field and
what to do, before any training (no traceback); Ctrl-C exits 130 with the checkpoint to resume from."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cohort_helpers import cohort, write_jsonl

from vlm_corl.commands.train import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tiny_zoo, tmp_path_factory) -> dict[str, Path]:
    """A good member directory and broken copies of it."""
    root = tmp_path_factory.mktemp("broken")
    good = Path(tiny_zoo["qwen2_vl"])
    out = {"good": good, "text": Path(tiny_zoo["qwen3"])}
    for name, breaks in {
        "no_weights": lambda d: (d / "model.safetensors").unlink(),
        "corrupt_weights": lambda d: (d / "model.safetensors").write_bytes(os.urandom(1000)),
        "bad_config": lambda d: (d / "config.json").write_text("{nope"),
        "unknown_type": lambda d: (d / "config.json").write_text(
            (d / "config.json").read_text().replace('"model_type": "qwen2_vl"', '"model_type": "nosuch"')
        ),
        "no_tokenizer": lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
    }.items():
        shutil.copytree(good, root / name)
        breaks(root / name)
        out[name] = root / name
    return out


MISTAKES = {  # name: (overrides, a piece of the first line of the message)
    "weights missing": (["members.0.model={no_weights}"], "member 'q': cannot load {no_weights} (OSError"),
    "weights corrupt": (
        ["members.0.model={corrupt_weights}"],
        "member 'q': cannot load {corrupt_weights} (SafetensorError",
    ),
    "config.json invalid": (
        ["members.0.model={bad_config}"],
        "cannot read the model type from config.json (JSONDecodeError",
    ),
    "unknown model_type": (
        ["members.0.model={unknown_type}"],
        "model_type 'nosuch' has no registered family and is neither",
    ),
    "tokenizer missing": (["members.0.model={no_tokenizer}"], "has no tokenizer files"),
    "family contradicts config.json": (["members.0.family=mllama"], "family 'mllama' contradicts its config.json"),
    "text member, image data": (["members.0.model={text}"], "is a text-only qwen3 model but the data has images"),
    "data file missing": (
        ["data.train.loader=jsonl", "data.train.path={tmp}/none.jsonl"],
        "none.jsonl does not exist: check the data path (data.train.path",
    ),
    "loader option typo": (["data.train.options={{limt: 3}}"], "does not take these options ['limt']"),
    "empty data file": (["data.train.loader=jsonl", "data.train.path={tmp}/empty.jsonl"], "no usable example in"),
    "skip beyond the data": (
        ["data.train.loader=jsonl", "data.train.path={tmp}/one.jsonl", "data.train.skip=5", "data.train.limit=null"],
        "no training examples left (1 loaded, skip=5",
    ),
    "prompt too long": (
        ["rollout.max_prompt_tokens=5"],
        "training examples fit rollout.max_prompt_tokens",
    ),
    "output_dir is a file": (["output_dir={tmp}/a_file"], "is a file; choose a directory"),
    "output_dir cannot be made": (["output_dir=/proc/corl-run"], "output_dir /proc/corl-run cannot be written"),
    "image cap below the processor": (
        ["data.max_image_pixels=100"],
        "100 pixels is below the smallest image the processor of member 'q' takes (256",
    ),
    "resume without a checkpoint": (["train.resume=true"], "train.resume=true but"),
    "batch larger than the data": (
        ["data.batch_size=20"],
        "data.batch_size=20 is larger than the 16 training examples",
    ),
    "member ranks outside the launch": (["members.0.ranks=[3]"], "is placed on ranks [3] but the launch has 1 process"),
    "deepspeed optimizer section": (["train.deepspeed={tmp}/ds.json"], "remove the 'optimizer' section"),
    "fp16 training": (["members.0.dtype=float16"], "members[0].dtype: float16 training needs loss scaling"),
    "unknown key": (["train.lrr=0.1"], "unknown key 'train.lrr'"),
}
if importlib.util.find_spec("vllm") is None:  # the main environment (the vLLM lane's has it)
    MISTAKES["vllm not installed"] = (  # refused before any model loads, with the install line
        ["members.0.engine=vllm"],
        "members[0].engine: member 'q' rolls out with vLLM, which is not installed here: pip install -e '.[vllm]'",
    )


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_user_mistake_exits_2_with_the_fix(models, tmp_path, capsys, mistake):
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "one.jsonl", [{"id": "a", "question": "1+1?", "answer": "2"}])
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}')
    cfg = cohort(
        tmp_path,
        [("q", models["good"])],
        data={"train": {"loader": "easyvqa", "limit": 16}, "batch_size": 2},
        reward={"mode": "self_vote"},
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    overrides, expected = MISTAKES[mistake]
    names = {k: str(v) for k, v in models.items()} | {"tmp": str(tmp_path)}
    code = main(["--config", str(path), *[o.format(**names) for o in overrides]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected.format(**names) in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before any training


def test_ctrl_c_exits_130_naming_the_checkpoint_to_resume_from(models, tmp_path):
    cfg = cohort(
        tmp_path,
        [("q", models["good"])],
        data={"train": {"loader": "easyvqa", "limit": 64}, "batch_size": 8},
        reward={"mode": "self_vote"},
    )
    cfg["train"].update(max_steps=100_000, save_every=5)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # A job started in the background by a non-interactive shell inherits SIGINT ignored (so that Ctrl-C in
    # the terminal spares it); Python then installs no KeyboardInterrupt handler. Restore the default.
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlm_corl.train", "--config", str(path)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 7):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()  # never leave a training process behind
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"interrupted at step \d+ \(\w+\); resume from .*/checkpoints/step-\d+ with train.resume=true", last
    ), last


def test_a_tokenizer_without_a_pad_token_pads_with_eos(models, tmp_path):
    """Many released tokenizers have no pad token; batches need one (its positions are masked out)."""
    import json

    from vlm_corl.config import MemberConfig
    from vlm_corl.members.member import load_member

    text = tmp_path / "nopad"
    shutil.copytree(models["text"], text)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = text / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg.pop("pad_token", None)
            f.write_text(json.dumps(cfg))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(text).pad_token_id is None  # the case this test is about
    member = load_member(MemberConfig(id="t", model=str(text)))
    assert member.tokenizer.pad_token == member.tokenizer.eos_token == "<|im_end|>"


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory) -> Path:
    """A finished 2-step run with a checkpoint per step, and its config."""
    root = tmp_path_factory.mktemp("trained")
    cfg = cohort(
        root,
        [("q", models["good"])],
        data={"train": {"loader": "easyvqa", "limit": 16}, "batch_size": 2},
        reward={"mode": "self_vote"},
    )
    cfg["train"]["save_every"] = 1
    (root / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(root / "c.yaml")]) == 0
    return root


@pytest.mark.parametrize(
    "mistake, breaks, expected",
    [
        ("member renamed", None, "(['q'] there, ['renamed'] now): the cohort's members and their order"),
        ("corrupt trainer_state.pt", "step-2/q/trainer_state.pt", "step-2/q/trainer_state.pt cannot be read"),
        ("empty cohort_state.pt", "step-2/cohort_state.pt", "step-2/cohort_state.pt cannot be read (EOFError"),
    ],
)
def test_a_resume_mistake_names_the_file(trained, tmp_path, capsys, mistake, breaks, expected):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    overrides = ["train.resume=true", "train.max_steps=3", f"output_dir={run}"]
    if breaks is None:
        overrides.append("members.0.id=renamed")
    else:
        (run / "checkpoints" / breaks).write_bytes(b"" if breaks.endswith("cohort_state.pt") else os.urandom(64))
    assert main(["--config", str(trained / "c.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    if breaks is not None:  # and what to do about it
        assert f"Move {run / 'checkpoints' / 'step-2'} out of checkpoints/ to resume from the one before it" in err


@pytest.mark.parametrize("content", [os.urandom(300), "name: caf\xe9\n".encode("latin-1")], ids=["binary", "latin-1"])
def test_a_config_that_is_not_utf8_text_exits_2_naming_the_byte(tmp_path, capsys, content):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not UTF-8 text (byte 0x" in err and "Traceback" not in err


def test_a_full_disk_while_checkpointing_names_the_directory_and_the_checkpoint_kept(models, tmp_path, capsys):
    import errno

    from vlm_corl.members.member import Member

    cfg = cohort(tmp_path, [("q", models["good"])], reward={"mode": "entropy"})
    cfg["train"].update(max_steps=3, save_every=1)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    real_save, calls = Member.save, []

    def save(self, directory, write=True):
        calls.append(directory)
        if ".tmp-step-2" in str(directory):  # the second checkpoint's weights meet a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, directory, write)

    Member.save = save
    try:
        code = main(["--config", str(path)])
    finally:
        Member.save = real_save
    err = capsys.readouterr().err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert code == 2, err
    assert f"the disk holding {checkpoints} filled while checkpoint step 2 was written" in err
    assert f"the previous checkpoint {checkpoints / 'step-1'} is intact" in err and "train.resume=true" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1"]  # the partial one removed
    code = main(["--config", str(path), "train.resume=true"])  # after freeing space: resumes from step 1
    assert code == 0, capsys.readouterr().err


def test_a_truncated_weights_file_in_a_checkpoint_says_to_move_the_checkpoint_away(models, tmp_path, capsys):
    cfg = cohort(tmp_path, [("q", models["good"])], reward={"mode": "entropy"})
    cfg["train"].update(max_steps=2, save_every=1)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(path)]) == 0
    weights = tmp_path / "run" / "checkpoints" / "step-2" / "q" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["--config", str(path), "train.resume=true", "train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    step2 = tmp_path / "run" / "checkpoints" / "step-2"
    assert f"{step2 / 'q'} cannot be read (SafetensorError" in err
    assert f"Move {step2} out of checkpoints/ to resume from the one before it" in err and "Traceback" not in err

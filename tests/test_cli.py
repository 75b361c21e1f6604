"""Every command through `python -m`, as users run it: each does its job at its smallest size, and each ends a
user mistake with one `error:` line and exit status 2, never a traceback; the mistakes of every command
(beyond `train`'s, in test_user_errors) in one table, run in process through `cli.run` like `__main__` does."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from cohort_helpers import cohort, python_m, write_jsonl

from vlm_corl import cli
from vlm_corl.commands import main as corl

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tiny_zoo, tmp_path_factory) -> dict[str, Path]:
    """Inputs for the mistakes: a file where a directory belongs, corrupt weights, data without answers, runs
    without metrics, a trained run with checkpoints."""
    root = tmp_path_factory.mktemp("mistakes")
    (root / "afile").write_text("x")
    shutil.copytree(tiny_zoo["qwen2_vl"], root / "corrupt")
    (root / "corrupt" / "model.safetensors").write_bytes(os.urandom(1000))
    write_jsonl(root / "nogold.jsonl", [{"id": "a", "question": "1+1?"}, {"id": "b", "question": "2+2?"}])
    write_jsonl(root / "gold.jsonl", [{"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)} for i in range(8)])
    (root / "empty.jsonl").write_text("")
    (root / "bad.yaml").write_text("garbage{\n")
    (root / "no_metrics").mkdir()
    (root / "empty_metrics").mkdir()
    (root / "empty_metrics" / "metrics.jsonl").write_text("")
    (root / "bad_metrics").mkdir()
    (root / "bad_metrics" / "metrics.jsonl").write_text('not json\n{"step": 1}\n')
    (root / "empty_dir").mkdir()
    (root / "twice").mkdir()  # two runs' rows in one metrics file
    rows = [{"step": s, "member": "a", "reward_mean": 0.5} for s in (1, 2)]
    write_jsonl(root / "twice" / "metrics.jsonl", rows + rows)
    (root / "demo_unknown.yaml").write_text(f"output_dir: {root}/d\nmembers:\n  - {{id: zed, model: {root}/zed}}\n")
    return {"root": root, **{k: Path(v) for k, v in tiny_zoo.items()}}


# command, argv (formatted with the files), a piece of the error message
MISTAKES = [
    ("zoo", "--out {root}/afile --families qwen3", "--out {root}/afile is a file; give a directory"),
    ("zoo", "--out /proc/zoo --families qwen3", "--out /proc/zoo cannot be written"),
    ("zoo", "--out {root}/z --families qwen9", "Did you mean 'qwen3'?"),
    ("warmstart", "--model {root}/nope --out {root}/w", "member 'w' ({root}/nope): the model directory does not exist"),
    ("warmstart", "--model {root}/corrupt --out {root}/w --limit 3", "cannot load {root}/corrupt (SafetensorError"),
    ("warmstart", "--model {qwen2_vl} --out {root}/w --loader nope", "unknown loaders 'nope'"),
    (
        "warmstart",
        "--model {qwen3} --out {root}/w --loader jsonl --path {root}/none.jsonl",
        "none.jsonl does not exist",
    ),
    ("warmstart", "--model {qwen2_vl} --out {root}/afile", "--out {root}/afile is a file"),
    ("warmstart", "--model {qwen2_vl} --out {root}/w --balance-by colr", "cannot balance by 'colr'"),
    ("warmstart", "--model {qwen2_vl} --out {root}/w --skip 10000000", "skip=10000000 leaves no example"),
    ("warmstart", "--model {qwen3} --out {root}/w --limit 3", "is a text-only qwen3 model but the data has images"),
    ("warmstart", "--model {qwen3} --out {root}/w --loader jsonl --path {root}/empty.jsonl", "no usable example in"),
    ("probe", "--models {qwen2_vl} {root}/nope --limit 3", "the model directory does not exist"),
    ("probe", "--models {qwen2_vl} {mllama} --benchmark easyvq", "Did you mean 'easyvqa'?"),
    ("probe", "--models {qwen2_vl} {mllama} --limit 3 --out {root}/afile", "is a file; give a directory"),
    ("probe", "--models {qwen2_vl} {qwen3} --limit 3", "is a text-only qwen3 model but the data has images"),
    ("probe", "--models {qwen2_vl} {mllama} --limit 2", "a limit of 2 cannot be balanced over the 3 values"),
    ("report", "{root}/nope", "run directory {root}/nope does not exist"),
    ("report", "{root}/no_metrics", "metrics.jsonl not found: is this a training run directory"),
    ("report", "{root}/empty_metrics", "metrics.jsonl has no rows yet"),
    ("report", "{root}/bad_metrics", "metrics.jsonl line 1 is not JSON"),
    ("report", "{root}/twice", "holds two rows for step 1 of member 'a' (rows 1 and 3): it mixes two runs"),
    ("eval", "--models {root}/nope --benchmarks easyvqa --out {root}/eval_out --limit 3", "does not exist"),
    ("demo", "--config {root}/none.yaml", "none.yaml: cannot read the config file"),
    ("demo", "--config {root}/bad.yaml", "bad.yaml: the top level must be a mapping of sections"),
    ("demo", "--eval-limit 3 train.lrr=1", "unknown key 'train.lrr'"),
    ("experiments.easyvqa", "--out {root}/empty_dir --plots-only", "results.json does not exist: run the experiment"),
    ("experiments.easyvqa", "--out {root}/afile --quick", "--out {root}/afile is a file"),
    (
        "paraphrase",
        "--data {root}/nogold.jsonl --model {root}/nope --out {root}/p.jsonl",
        "the model directory does not exist",
    ),
    (
        "paraphrase",
        "--data {root}/nogold.jsonl --model {qwen3} --out {root}/empty_dir",
        "is a directory; give the paraphrase cache's",
    ),
    (
        "paraphrase",
        "--data {root}/nogold.jsonl --model {qwen3} --out {root}/p.jsonl --loader mypkg:load",
        "cannot load loaders 'mypkg:load': No module named 'mypkg'",
    ),
]


def _main(command: str):
    import importlib

    module = "data_tools.paraphrase" if command == "paraphrase" else f"vlm_corl.{command}"
    return importlib.import_module(module).main


@pytest.mark.parametrize("command, argv, message", MISTAKES, ids=[f"{c}: {a}" for c, a, _ in MISTAKES])
def test_a_mistake_exits_2_with_one_line(files, capsys, command, argv, message):
    names = {k: str(v) for k, v in files.items()}
    with torch.random.fork_rng():
        code = cli.run(_main(command), argv.format(**names).split())
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message.format(**names) in err
    assert "Traceback" not in err


def test_argument_mistakes_are_argparse_errors(capsys):
    for command, argv in [
        ("warmstart", "--model m --out o --steps 0"),
        ("report", "r --smooth 0"),
        ("probe", "--models a b --limit -1"),
        ("demo", "--eval-limit 0"),
        ("experiments.easyvqa", "--out o --seeds 0"),
        ("paraphrase", "--data d --model m --out o --n 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.run(_main(command), argv.split())
        assert exit_.value.code == 2
        assert "must be at least 1" in capsys.readouterr().err, command


def test_a_command_run_as_corl_name_says_so_in_its_usage(capsys):
    """`corl plan --help` and `corl config --help` show `usage: corl plan ...`, not the module's python -m name;
    after the command the name is cleared (the module's own stays for python -m)."""
    for command in ("plan", "config", "zoo"):
        assert corl([command, "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: corl {command} "), command
    assert cli.invoked_as is None
    assert cli.parser("python -m vlm_corl.plan", None).prog == "python -m vlm_corl.plan"


def test_a_failed_eval_leaves_no_empty_out_behind(files, capsys):
    out = files["root"] / "eval_gone"
    argv = ["--models", str(files["root"] / "nope"), "--benchmarks", "easyvqa", "--out", str(out), "--limit", "3"]
    assert cli.run(_main("eval"), argv) == 2
    assert not out.exists(), "a failed eval left its --out behind"
    out.mkdir()  # a directory that was there before is the user's: kept
    assert cli.run(_main("eval"), argv) == 2 and out.is_dir()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_a_usage_error(files, capsys):
    for command, argv in [
        ("paraphrase", f"--data {files['root']}/nogold.jsonl --model {files['qwen3']} --out o.jsonl --device cuda"),
        ("zoo", "--real qwen2-vl-2b-instruct --out o --device cuda:1"),
        ("zoo", "--real qwen2-vl-2b-instruct --out o --device gpu"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.run(_main(command), argv.split())
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "this machine has no CUDA device" in err or "'gpu' is not a device" in err, err


def test_debug_shows_the_traceback(files):
    with pytest.raises(cli.UserError, match="is a file"):
        cli.run(_main("zoo"), ["--out", str(files["root"] / "afile"), "--debug"])


def test_every_command_through_python_m_ends_a_mistake_with_exit_2(files):
    """The `__main__` wiring of every command (in parallel: each start imports torch)."""
    root = files["root"]
    runs = {
        "vlm_corl.train": ["--config", root / "none.yaml"],
        "text_corl.train": ["--config", root / "bad.yaml"],
        "vlm_corl.config": [root / "bad.yaml"],
        "vlm_corl.eval": ["--models", files["qwen2_vl"], "--benchmarks", "easyvqa", "--out", root / "afile"],
        "vlm_corl.zoo": ["--out", root / "afile"],
        "vlm_corl.warmstart": ["--model", root / "nope", "--out", root / "w2"],
        "vlm_corl.probe": ["--models", files["qwen2_vl"], root / "nope", "--limit", 3],
        "vlm_corl.report": [root / "no_metrics"],
        "vlm_corl.demo": ["--config", root / "demo_unknown.yaml"],
        "vlm_corl.experiments.easyvqa": ["--out", root / "empty_dir", "--plots-only"],
        "data_tools.paraphrase": ["--data", root / "none.jsonl", "--model", files["qwen3"], "--out", root / "p.jsonl"],
    }
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(runs, pool.map(lambda item: python_m(item[0], *item[1]), runs.items())))
    for module, proc in done.items():
        assert proc.returncode == 2, (module, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, module
        first = proc.stderr.strip().splitlines()[0]
        assert "error" in first or "invalid" in first or "config problem" in first, (module, first)


def test_zoo_warmstart_probe_and_report_through_python_m(files, tmp_path):
    zoo = python_m("vlm_corl.zoo", "--out", tmp_path / "zoo", "--families", "qwen3,qwen2")
    assert zoo.returncode == 0, zoo.stderr[-2000:]
    assert zoo.stdout.split()[:3] == ["family", "path", "parameters"]

    warm = python_m(
        "vlm_corl.warmstart",
        "--model",
        tmp_path / "zoo" / "qwen3",
        "--out",
        tmp_path / "base",
        "--loader",
        "jsonl",
        "--path",
        files["root"] / "gold.jsonl",
        "--limit",
        8,
        "--steps",
        3,
        "--batch-size",
        4,
    )
    assert warm.returncode == 0, warm.stderr[-2000:]
    record = json.loads(warm.stdout)
    assert record["steps"] == 3 and record["examples"] == 8 and record["last_loss"] < record["first_loss"] + 1
    assert (tmp_path / "base" / "model.safetensors").is_file()

    probe = python_m(
        "vlm_corl.probe",
        "--models",
        f"a={tmp_path / 'base'}",
        f"b={tmp_path / 'zoo' / 'qwen2'}",
        "--benchmark",
        "math500",
        "--limit",
        4,
        "--out",
        tmp_path / "probe",
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    report = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert report["n"] == 4 and set(report["records"]) == {"a", "b"}

    cfg = cohort(
        tmp_path,
        [("t", tmp_path / "base")],
        data={"train": {"loader": "jsonl", "path": str(files["root"] / "gold.jsonl")}, "batch_size": 4},
        reward={"mode": "self_vote"},
    )
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    train = python_m("text_corl.train", "--config", tmp_path / "c.yaml")
    assert train.returncode == 0, train.stderr[-2000:]
    rendered = python_m("vlm_corl.report", tmp_path / "run")
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    assert "logged steps: 2 (1–2)" in (tmp_path / "run" / "report.md").read_text()


def test_demo_through_python_m_at_its_smallest(tmp_path):
    """The README's first command end to end at toy size, as a user runs it: the shipped base models copied,
    scored, trained on two processes (torchrun, as `make demo`), scored again; demo.json holds the gain and the
    pinned kernels. (`--rebuild-base` runs in tests/test_demo_bases.py, slow.)"""
    demo = python_m(
        "vlm_corl.demo",
        "--config",
        ROOT / "configs" / "cohorts" / "tiny_easyvqa.yaml",
        "--eval-limit",
        3,
        "train.max_steps=1",
        "data.batch_size=2",
        "rollout.n=2",
        "logging.report_to=[]",
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "[demo] 3. label-free Co-RL: peers_ema rewards, 1 steps" in demo.stdout
    assert "4 members on 2 process(es)" in demo.stdout and "cohort gain:" in demo.stdout
    result = json.loads((tmp_path / "out" / "demo" / "demo.json").read_text())
    members = {"qwen2_vl", "qwen2_vl_b", "qwen2_vl_c", "qwen2_vl_d"}
    assert result["eval_questions"] == 3 and set(result["members"]) == members
    assert all("shipped" in b for b in result["base_models"].values())
    gains = [m["gain_points"] for m in result["members"].values()]
    assert result["gain_points"] == pytest.approx(sum(gains) / 4, abs=0.01)
    assert result["machine"]["pinned"]["ATEN_CPU_CAPABILITY"] == "avx2" and result["machine"]["torch_threads"] == 1
    assert (tmp_path / "runs" / "tiny_easyvqa" / "summary.json").is_file()

"""`python -m vlm_corl.eval` on both registries' benchmarks: easy-vqa (vision) and MATH-500 (text, via text_corl)."""

import json
import shutil

import pytest
import torch

from text_corl.data import MATH500_DIR
from vlm_corl import cli
from vlm_corl.commands.eval import main

MATH500 = MATH500_DIR


def test_eval_writes_results_for_a_vision_and_a_text_benchmark(tiny_zoo, tmp_path):
    main(
        ["--models", str(tiny_zoo["qwen2_vl"]), "--benchmarks", "easyvqa", "--limit", "6", "--out", str(tmp_path / "v")]
    )
    vision = json.loads((tmp_path / "v" / "results.json").read_text())[str(tiny_zoo["qwen2_vl"])]["easyvqa"]
    assert vision["n"] == 6 and set(vision["by_type"]) == {"yes/no", "shape", "color"}
    # the numbers are those of the records: accuracy their mean, each type's the mean of its 2 (balanced)
    records = vision["records"]
    assert vision["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 6)
    for qtype, acc in vision["by_type"].items():
        mine = [r["correct"] for r in records if r["type"] == qtype]
        assert len(mine) == 2 and acc == pytest.approx(sum(mine) / 2)
    assert "| easyvqa | 6 |" in (tmp_path / "v" / "results.md").read_text()
    main(
        [
            "--models",
            str(tiny_zoo["qwen3"]),
            "--benchmarks",
            "math500",
            "--limit",
            "2",
            "--data",
            f"math500={MATH500}",
            "--out",
            str(tmp_path / "t"),
        ]
    )
    text = json.loads((tmp_path / "t" / "results.json").read_text())[str(tiny_zoo["qwen3"])]["math500"]
    assert text["n"] == 2 and len(text["records"]) == 2


def test_eval_cli_runs_a_text_benchmark_through_python_m(tiny_zoo, tmp_path):
    """`python -m vlm_corl.eval` once imported itself twice and registered easy-vqa twice (a crash for math500)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlm_corl.eval",
            "--models",
            str(tiny_zoo["qwen3"]),
            "--benchmarks",
            "math500",
            "--limit",
            "2",
            "--out",
            str(tmp_path / "cli"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "cli" / "results.json").read_text())[str(tiny_zoo["qwen3"])]
    assert results["math500"]["n"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--limit", "-3"], "--limit: must be at least 1 (got -3)"),
        (["--limit", "0"], "--limit: must be at least 1 (got 0)"),
        (["--out", "{file}"], "is a file; give a directory"),
        (["--benchmarks", "easyvq"], "Did you mean 'easyvqa'?"),
        (["--models", "{tmp}/none"], "member 'none' ({tmp}/none): the model directory does not exist"),
        (["--limit", "2"], "a limit of 2 cannot be balanced over the 3 values of 'question_type'"),
        (["--models", "{text}"], "is a text-only qwen3 model but the data has images"),
        (
            ["--models", "{tmp}"],
            "not a model directory (no config.json), a LoRA adapter directory (no adapter_config.json), a complete",
        ),
        (["--engine", "vllm"], "--engine vllm needs vLLM: pip install"),
    ],
)
def test_eval_cli_mistakes_exit_2_before_evaluating(tiny_zoo, tmp_path, capsys, args, message):
    (tmp_path / "a_file").write_text("x")
    base = {
        "--models": str(tiny_zoo["qwen2_vl"]),
        "--benchmarks": "easyvqa",
        "--limit": "3",
        "--out": str(tmp_path / "o"),
    }
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value.format(file=tmp_path / "a_file", tmp=tmp_path, text=tiny_zoo["qwen3"])
    argv = [x for kv in base.items() for x in kv]
    try:
        code = cli.run(main, argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "o" / "results.json").exists()


def test_a_cohort_checkpoint_or_its_run_directory_evaluates_every_member(tiny_zoo, tmp_path):
    """A run directory (its newest complete checkpoint) and a checkpoint directory name every model the
    checkpoint's manifest lists; an incomplete newer checkpoint is passed over."""
    run = tmp_path / "run"
    for step, complete in ((2, True), (3, False)):
        ckpt = run / "checkpoints" / f"step-{step}"
        for mid in ("a", "b"):
            shutil.copytree(tiny_zoo["qwen2_vl"], ckpt / mid)
        if complete:
            files = ["config.json", "model.safetensors"]
            (ckpt / "manifest.json").write_text(json.dumps({"step": step, "members": {"a": files, "b": files}}))
            torch.save({"step": step}, ckpt / "cohort_state.pt")
    for given in (run, run / "checkpoints" / "step-2"):
        out = tmp_path / f"out-{given.name}"
        main(["--models", str(given), "--benchmarks", "easyvqa", "--limit", "3", "--out", str(out)])
        results = json.loads((out / "results.json").read_text())
        assert sorted(results) == [str(run / "checkpoints" / "step-2" / m) for m in ("a", "b")]
        assert all(r["easyvqa"]["n"] == 3 for r in results.values())

"""`corl preflight` checks its own inputs before any model loads (vlm_corl/commands/preflight.py check_paths): an
--out that is a directory, or in a folder that cannot be written, and an output_dir that cannot be written, end
at once in exit 2 naming the path, with members whose weights are absent (configs/models/ holds only their
config.json: a load would fail with another message, so exit 2 with this one shows the check ran first). A
preflight.json that cannot be written at the end leaves the verdict printed (preflight_checks.write_report
returns why in place of raising)."""

from __future__ import annotations

from pathlib import Path

import yaml
from cohort_helpers import cohort

from vlm_corl import cli
from vlm_corl.commands.preflight import main
from vlm_corl.commands.preflight_checks import write_report

ROOT = Path(__file__).resolve().parents[1]
ABSENT_WEIGHTS = ROOT / "configs" / "models" / "qwen2.5-vl-7b-instruct"  # config.json only


def _config(tmp: Path, output_dir: Path) -> Path:
    cfg = cohort(tmp, [("a", ABSENT_WEIGHTS), ("b", ABSENT_WEIGHTS)])
    cfg["output_dir"] = str(output_dir)
    path = tmp / "cohort.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _unwritable(tmp: Path) -> Path:
    """A folder no one can make or write, root included: its parent is a file."""
    blocker = tmp / "a_file"
    blocker.write_text("")
    return blocker / "folder"


def _refused(capsys, *args: str) -> str:
    code = cli.run(main, list(args))
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    assert "verdict" not in captured.out and "Traceback" not in captured.err  # no check ran
    return captured.err


def test_an_out_that_is_a_directory_is_refused_before_any_load(tmp_path, capsys):
    path = _config(tmp_path, tmp_path / "run")
    err = _refused(capsys, "--config", str(path), "--out", str(tmp_path))
    assert f"--out {tmp_path} is a directory" in err and f"--out {tmp_path / 'preflight.json'}" in err
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_an_out_in_a_folder_that_cannot_be_written_is_refused(tmp_path, capsys):
    locked = _unwritable(tmp_path)
    path = _config(tmp_path, tmp_path / "run")
    err = _refused(capsys, "--config", str(path), "--out", str(locked / "preflight.json"))
    assert f"--out's folder {locked} cannot be written" in err and "choose another directory" in err


def test_an_output_dir_that_cannot_be_written_is_refused(tmp_path, capsys):
    locked = _unwritable(tmp_path)
    path = _config(tmp_path, locked / "run")
    err = _refused(capsys, "--config", str(path), "--out", str(tmp_path / "preflight.json"))
    assert f"output_dir {locked / 'run'} cannot be written" in err


def test_a_report_that_cannot_be_written_returns_why(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    report = {"verdict": "ready", "failure": None}
    why = write_report(report, blocker / "preflight.json", 0)  # its folder is a file: the write fails late
    assert why is not None and str(blocker) in why
    assert write_report(report, tmp_path / "preflight.json", 0) is None
    assert (tmp_path / "preflight.json").exists()

"""`python -m data_tools.validate` on a fixture with one record of each problem (tests/fixtures/validate): every
problem found once and named with its record, a clean split passes, a missing path is a user error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from data_tools.validate import main, validate
from vlm_corl import cli

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "validate"


def test_one_record_of_each_problem_is_found(capsys):
    reports, extra = validate(FIXTURE)
    assert {split: r.skipped for split, r in reports.items()} == {
        "test": {},
        "train": {
            "duplicate_id": 1,
            "empty_question": 1,
            "corrupt_image": 1,
            "missing_image": 1,
            "bad_record": 1,
            "undecodable_line": 1,
        },
    }
    assert extra.skipped == {
        "unloadable_split": 1,
        "missing_answer": 1,
        "unparseable_answer": 1,
        "choice_out_of_range": 1,
        "answer_not_a_choice": 1,
    }
    assert extra.samples["unparseable_answer"] == ["train: garbled"] and extra.kept == 4  # clean, word, choice-ok, t1
    assert cli.run(main, [str(FIXTURE)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{FIXTURE}: 14 records in 2 split(s) (test, train); 11 problem(s)\n")
    assert "choice_out_of_range         1  train: letter-E\n" in out and "broken: no usable example" in out


def test_a_clean_file_exits_0(capsys):
    assert cli.run(main, [str(FIXTURE / "test.jsonl")]) == 0
    assert capsys.readouterr().out == f"{FIXTURE / 'test.jsonl'}: 1 records in 1 split(s) (test); 0 problem(s)\n"


def test_no_such_path_is_a_user_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "data_tools.validate", str(tmp_path / "nope")],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr
        == f"error: {tmp_path / 'nope'} does not exist: give a record file (.jsonl) or a directory of them\n"
    )
    assert cli.run(main, [str(tmp_path)]) == 2  # a directory without records

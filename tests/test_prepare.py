"""`python -m data_tools.prepare` on tiny hand-made releases of every format (tests/fixtures/prepare, written by
make_fixtures.py there from the documented schemas): the exact records written, every skipped row counted by
reason, and the output read back by the "jsonl" loader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data_tools.prepare import main
from vlm_corl import cli
from vlm_corl.data.images import load_image
from vlm_corl.data.loaders import load_examples

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "prepare"
ROOT = Path(__file__).resolve().parents[1]


def prepare(tmp_path, fmt, src, *extra):
    out = tmp_path / "out"
    assert cli.run(main, ["--format", fmt, "--src", str(src), "--out", str(out), *map(str, extra)]) == 0
    report = json.loads((out / "prepare_report.json").read_text())
    return out, {split: r["skipped"] for split, r in report["splits"].items()}


def records(out: Path, split: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
    loaded = load_examples("jsonl", out, split=split)  # every record written loads, images included
    assert [e.id for e in loaded.examples] == [r["id"] for r in rows] and not loaded.report.skipped
    for row in rows:
        for image in row["images"]:
            load_image(out / image)
    return rows


def plain(id, question, answer, images=(), choices=None, paraphrases=(), **metadata):
    return {
        "id": id,
        "question": question,
        "images": list(images),
        "answer": answer,
        "choices": choices,
        "paraphrases": list(paraphrases),
        **metadata,
    }


def test_math_levels_boxed_answers_and_rephrasings(tmp_path):
    src = FIXTURES / "math" / "MATH"
    out, skipped = prepare(tmp_path, "math", src, "--rephrased", FIXTURES / "math" / "rephrased_train.jsonl")
    assert skipped == {"train": {"level_not_kept": 1, "no_boxed_answer": 1, "empty_question": 1}, "test": {}}
    assert records(out, "train") == [
        plain(
            "train/algebra/1.json",
            "What is $2+3$?",
            "5",
            paraphrases=["Add 2 and 3."],
            level=5,
            subject="Algebra",
            solution="$2+3=\\boxed{5}$.",
        ),
        plain(
            "train/geometry/1.json",
            "Half of $1$?",
            "\\frac{1}{2}",
            paraphrases=["What is 1 halved?"],
            level=4,
            subject="Geometry",
            solution="First \\boxed{1}, then \\boxed{\\frac{1}{2}}.",
        ),
    ]
    assert records(out, "test") == [
        plain("test/algebra/1.json", "What is $3 \\cdot 4$?", "12", level=4, subject="Algebra", solution="\\boxed{12}")
    ]
    out, skipped = prepare(tmp_path, "math", src, "--levels", "1,4")
    assert skipped["train"] == {"level_not_kept": 3}
    assert [r["answer"] for r in records(out, "train")] == ["2", "\\frac{1}{2}"]


def test_math_rephrasings_that_do_not_align_are_refused(tmp_path, capsys):
    rows = (FIXTURES / "math" / "rephrased_train.jsonl").read_text().splitlines()
    short, swapped = tmp_path / "short.jsonl", tmp_path / "swapped.jsonl"
    short.write_text("\n".join(rows[:-1]) + "\n")
    swapped.write_text("\n".join([rows[3], rows[1], rows[2], rows[0], rows[4]]) + "\n")
    args = ["--format", "math", "--src", str(FIXTURES / "math" / "MATH"), "--out", str(tmp_path / "out")]
    assert cli.run(main, [*args, "--rephrased", str(short)]) == 2
    train = FIXTURES / "math" / "MATH" / "train"
    assert f"--rephrased {short} has 4 rows but {train} has 5 problems" in capsys.readouterr().err
    assert cli.run(main, [*args, "--rephrased", str(swapped)]) == 2
    assert f"{swapped}:1 rewords another problem than" in capsys.readouterr().err


def test_dapo_wrapper_stripped_and_repeats_dropped(tmp_path):
    out, skipped = prepare(tmp_path, "dapo_math_17k", FIXTURES / "dapo_math_17k")
    assert skipped == {"train": {"duplicate_problem": 1, "no_answer": 1, "bad_record": 1}}
    assert records(out, "train") == [
        plain("dapo-a1", "Find $7 \\times 6$.", "42", data_source="math_dapo"),
        plain("dapo-b1", "How many primes are below 10?", "4", data_source="math_dapo"),
    ]


def test_geometry3k_parquet_and_intergps_folders(tmp_path):
    out, skipped = prepare(tmp_path, "geometry3k", FIXTURES / "geometry3k" / "hf")
    assert skipped == {"train": {"corrupt_image": 1}, "test": {}}
    assert records(out, "train") == [
        plain("geometry3k-train-000000", "Find x.", "3", images=["images/geometry3k-train-000000-0.png"])
    ]
    assert records(out, "test")[0]["question"] == "Find the area."
    out, skipped = prepare(tmp_path / "intergps", "geometry3k", FIXTURES / "geometry3k" / "intergps")
    assert skipped == {"train": {"missing_image": 1}, "val": {}}
    assert records(out, "train") == [
        plain(
            "geometry3k-0",
            "Find x.\nChoices:\n(A) 3\n(B) 4\n(C) 6\n(D) 8",
            "C",
            images=["images/geometry3k-0-0.png"],
            choices=["3", "4", "6", "8"],
            problem_type_graph=["Triangle"],
            problem_type_goal=["Length"],
        )
    ]
    assert (out / "images" / "geometry3k-0-0.png").read_bytes() == (
        FIXTURES / "geometry3k" / "intergps" / "train" / "0" / "img_diagram.png"
    ).read_bytes()


def test_open_r1_answer_from_the_solution(tmp_path):
    out, skipped = prepare(tmp_path, "multimodal_open_r1_8k_verified", FIXTURES / "multimodal_open_r1_8k_verified")
    assert skipped == {"train": {"no_answer": 1, "empty_question": 1}}
    assert records(out, "train") == [
        plain(
            "multimodal_open_r1_8k_verified-train-000000",
            "How many sides does the shape have?",
            "4",
            images=["images/multimodal_open_r1_8k_verified-train-000000-0.png"],
            solution="<think>It is a square.</think>\n\n<answer>4</answer>",
            original_question="Sides?",
            original_answer="4",
        )
    ]


def test_mmr1_images_in_their_own_encoding(tmp_path):
    out, skipped = prepare(tmp_path, "mmr1_math_rl", FIXTURES / "mmr1_math_rl")
    assert skipped == {"train": {"no_answer": 1}, "validation": {}}
    assert records(out, "train") == [
        plain(
            "mmr1_math_rl-train-000000", "What is the angle?", "90", images=["images/mmr1_math_rl-train-000000-0.jpg"]
        )
    ]
    assert records(out, "validation")[0]["answer"] == "5"


def test_a_source_that_is_not_the_release_is_one_error_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_tools.prepare",
            "--format",
            "dapo_math_17k",
            "--src",
            str(FIXTURES / "math"),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"error: --src {FIXTURES / 'math'} is not DAPO-Math-17k's parquet file, or a folder holding it"
    )
    assert not (tmp_path / "out").exists()  # checked before anything is written
    assert cli.run(main, ["--format", "math", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2


@pytest.mark.parametrize("argv", [["--levels", "0,3"], ["--format", "dapo_math_17k", "--levels", "3"]])
def test_option_mistakes(tmp_path, argv, capsys):
    base = {"--format": "math", "--src": str(FIXTURES / "math" / "MATH"), "--out": str(tmp_path / "o")}
    base.update(dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as exit_info:
        main([part for item in base.items() for part in item])
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err

"""Text benchmarks read in their official release formats (fixtures written from the documented schemas):
GSM8K's "#### <number>" answers, AMC23's float answers, GPQA's CSV with options shuffled by a fixed seed."""

import csv
import json

from cohort_helpers import write_jsonl

from text_corl.data import load_amc23, load_gpqa
from vlm_corl import cli
from vlm_corl.commands.eval import main
from vlm_corl.data.loaders import load_examples


def test_gsm8k_takes_the_number_after_the_hashes(tmp_path):
    write_jsonl(
        tmp_path / "test.jsonl",
        [
            {"question": "Ann has 3 apples and buys 1,200 more. How many?", "answer": "3 + 1200 = 1203\n#### 1,203"},
            {"question": "No final line", "answer": "it is 4"},
        ],
    )
    loaded = load_examples("gsm8k", tmp_path, split="test")
    assert [(e.id, e.answer) for e in loaded.examples] == [("gsm8k-test-000001", "1203")]
    assert loaded.report.skipped == {"no_final_answer": 1}
    assert loaded.examples[0].metadata["solution"].endswith("#### 1,203")


def test_amc23_answers_written_as_floats_become_integers(tmp_path):
    write_jsonl(
        tmp_path / "test.jsonl",
        [{"id": 0, "question": "Find x.", "answer": 27.0, "url": "u"}, {"id": 1, "problem": "Find y.", "answer": 0.5}],
    )
    examples = list(load_amc23(tmp_path / "test.jsonl"))
    assert [(e.id, e.question, e.answer) for e in examples] == [
        ("amc23-0", "Find x.", "27"),
        ("amc23-1", "Find y.", "0.5"),
    ]
    assert examples[0].metadata == {"id": 0, "url": "u"}


def test_gpqa_options_are_shuffled_the_same_way_every_time_and_the_gold_letter_follows(tmp_path):
    header = [
        "Question",
        "Correct Answer",
        "Incorrect Answer 1",
        "Incorrect Answer 2",
        "Incorrect Answer 3",
        "Record ID",
        "High-level domain",
        "Subdomain",
    ]
    rows = [[f"Q{i}?", f"right{i}", f"w{i}a", f"w{i}b", f"w{i}c", f"rec{i}", "Physics", "Optics"] for i in range(6)]
    rows.append(["Q?", "right", "", "x", "y", "recbad", "Biology", "Genetics"])  # a missing option
    with open(tmp_path / "gpqa_diamond.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    first = [e for e in load_gpqa(tmp_path) if hasattr(e, "choices")]
    again = [e for e in load_gpqa(tmp_path) if hasattr(e, "choices")]
    assert len(first) == 6 and [e.choices for e in first] == [e.choices for e in again]
    for i, e in enumerate(first):
        assert e.choices["ABCD".index(e.answer)] == f"right{i}" and sorted(e.choices) == sorted(rows[i][1:5])
    assert len({e.answer for e in first}) > 1  # the correct option does not always come first
    assert first[0].metadata == {"domain": "Physics", "subdomain": "Optics"}
    # the prompt renders the question alone, so it lists the options in their shuffled order
    assert first[0].question == "Q0?\nChoices:\n" + "\n".join(f"({k}) {c}" for k, c in zip("ABCD", first[0].choices))
    assert load_examples("gpqa", tmp_path, split="diamond").report.skipped == {"bad_record": 1}


def test_gsm8k_through_the_eval_cli_and_its_missing_data_message(tiny_zoo, tmp_path, capsys):
    write_jsonl(
        tmp_path / "test.jsonl", [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(3)]
    )
    assert (
        cli.run(
            main,
            [
                "--models",
                str(tiny_zoo["qwen3"]),
                "--benchmarks",
                "gsm8k",
                "--data",
                f"gsm8k={tmp_path}",
                "--limit",
                "2",
                "--out",
                str(tmp_path / "o"),
            ],
        )
        == 0
    )
    result = json.loads((tmp_path / "o" / "results.json").read_text())[str(tiny_zoo["qwen3"])]["gsm8k"]
    assert result["n"] == 2 and result["decoding"]["temperature"] == 0.6
    assert (
        cli.run(main, ["--models", str(tiny_zoo["qwen3"]), "--benchmarks", "gsm8k", "--out", str(tmp_path / "o2")]) == 2
    )
    # no path: the hub's copy, which this machine cannot reach, so the message asks for --data
    err = capsys.readouterr().err
    assert "the 'gsm8k' loader got no path and cannot load openai/gsm8k from the Hugging Face hub" in err
    assert "--data gsm8k=PATH" in err

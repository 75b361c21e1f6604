"""The multimodal math benchmarks (MathVista, MathVerse, MATH-Vision, We-Math) read from fixtures written by hand
in their official release formats (tests/fixtures/<benchmark>), graded by their rules on hand-picked responses,
their breakdowns and We-Math's four dimensions on canned answers, and one evaluation through the CLI."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_corl import cli
from vlm_corl.commands import eval as ev
from vlm_corl.config import MemberConfig
from vlm_corl.data.images import load_image
from vlm_corl.data.loaders import DataError, load_examples
from vlm_corl.data.mapped import TableImage
from vlm_corl.evaluation import scoring
from vlm_corl.evaluation.benchmarks.common import grade_response
from vlm_corl.evaluation.benchmarks.mathverse import MATHVERSE
from vlm_corl.evaluation.benchmarks.mathvision import MATHVISION
from vlm_corl.evaluation.benchmarks.mathvista import MATHVISTA, grade_mathvista
from vlm_corl.evaluation.benchmarks.wemath import WEMATH, four_dimensional
from vlm_corl.members.member import load_member
from vlm_corl.members.rollout import Response, RolloutGroup

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SPLITS = {"mathvista": "testmini", "mathverse": "testmini", "mathvision": "test", "wemath": "testmini"}


@functools.lru_cache(maxsize=None)
def examples(name: str, path=None) -> dict:
    """{id: example} of a benchmark's fixture (or of its data at `path`), every record kept."""
    loaded = load_examples(name, path or FIXTURES / name, split=SPLITS[name])
    assert loaded.report.skipped == {}
    return {ex.id: ex for ex in loaded.examples}


def test_mathvista_release_json_loads_with_its_prompt_choices_and_categories():
    exs = examples("mathvista")
    assert list(exs) == [str(i) for i in range(1, 19)]
    assert all(load_image(ex.images[0]).size == (16, 16) for ex in exs.values())
    assert exs["3"].choices == ("135°", "140°", "145°", "150°") and exs["3"].answer == "145°"
    assert exs["3"].question.endswith("BOC?\nChoices:\n(A) 135°\n(B) 140°\n(C) 145°\n(D) 150°")
    assert exs["2"].choices is None and exs["2"].question.endswith("scale? (Unit: g)\nAnswer with an integer.")
    assert exs["11"].question.endswith("\nAnswer with a number with 2 decimal places.")
    assert exs["13"].question.endswith("\nAnswer with a Python list, e.g. [1, 2, 3].")
    meta = exs["3"].metadata
    assert (meta["task"], meta["skills"], meta["answer_type"]) == (
        "geometry problem solving",
        ["geometry reasoning", "algebraic reasoning"],
        "text",
    )


def test_mathvista_hugging_face_parquet_release_reads_the_same(tmp_path):
    """AI4Math/MathVista's layout: data/testmini-*.parquet, the picture in the decoded_image column."""
    import datasets

    release = json.loads((FIXTURES / "mathvista" / "testmini.json").read_text())
    rows = [
        {
            **r,
            "decoded_image": {"bytes": (FIXTURES / "mathvista" / r["image"]).read_bytes(), "path": None},
            "query": r["question"],
        }
        for r in release.values()
    ]
    (tmp_path / "data").mkdir()
    dataset = datasets.Dataset.from_list(rows).cast_column("decoded_image", datasets.Image())
    dataset.to_parquet(str(tmp_path / "data" / "testmini-00000-of-00001.parquet"))
    from_json, from_parquet = examples("mathvista"), examples("mathvista", tmp_path)
    assert list(from_parquet) == list(from_json)
    assert [(e.question, e.choices, e.answer) for e in from_parquet.values()] == [
        (e.question, e.choices, e.answer) for e in from_json.values()
    ]
    # the parquet release's embedded pictures: references into its memory-mapped Arrow files, equal to the bytes
    assert isinstance(from_parquet["1"].images[0], TableImage) and from_parquet["11"].metadata["precision"] == 2
    assert load_image(from_parquet["1"].images[0]).size == load_image(from_json["1"].images[0]).size


@pytest.mark.parametrize(
    "pid, response, right",
    [
        ("3", "<answer>C</answer>", True),  # the letter
        ("3", "\\boxed{145°}", True),  # the option's text
        ("3", "C", True),  # a bare letter
        ("3", "<answer>B</answer>", False),
        ("9", "The answer is E.", True),  # options that are letters themselves
        ("9", "<answer>D</answer>", False),
        ("1", "\\boxed{1.23}", True),  # rounded to the problem's precision (1 decimal)
        ("1", "\\boxed{1.3}", False),
        ("11", "\\boxed{51.044}", True),  # precision 2
        ("11", "\\boxed{51.0}", False),
        ("2", "\\boxed{1000 g}", True),  # the unit is stripped
        ("2", "\\boxed{1000\\text{ g}}", True),
        ("2", "<answer>1,000</answer>", True),
        ("2", "\\boxed{1000.7}", True),  # integers are truncated, as the official int(float(x)) does
        ("2", "\\boxed{999}", False),
        ("12", "So the answer is 11 years.", True),
        ("12", "\\boxed{12 years}", False),
        ("13", "\\boxed{[2014, 2016]}", True),  # lists element-wise
        ("13", "<answer>2014, 2016</answer>", True),
        ("13", "\\boxed{[2016, 2014]}", False),
        ("13", "\\boxed{[2014]}", False),
        ("17", "\\boxed{\\frac{4}{5}}", True),  # no plain number: math-verify
        ("17", "I cannot tell.", False),
    ],
)
def test_mathvista_grading_rules(pid, response, right):
    assert grade_mathvista(examples("mathvista")[pid], response) is right


def test_mathverse_versions_choices_and_grading():
    exs = examples("mathverse")
    assert list(exs) == [str(i) for i in range(1, 11)]
    assert [exs[str(i)].metadata["problem_version"] for i in range(1, 6)] == [
        "Text Dominant",
        "Text Lite",
        "Vision Intensive",
        "Vision Dominant",
        "Vision Only",
    ]
    assert all(load_image(ex.images[0]).size == (16, 16) for ex in exs.values())
    assert exs["6"].choices == ("50°", "60°", "65°", "90°") and exs["6"].answer == "C"
    assert exs["1"].choices is None and exs["5"].question == "Answer the question shown in the image."
    assert exs["10"].choices == ("A", "B", "C", "D")  # vision only: the options are in the picture
    assert exs["6"].metadata["subject"] == "Plane Geometry"
    for sid, response, right in [
        ("6", "C", True),
        ("6", "<answer>65°</answer>", True),
        ("6", "\\boxed{B}", False),
        ("10", "(C)", True),
        ("10", "65°", False),
        ("1", "\\boxed{14}", True),
        ("1", "\\boxed{14 cm}", True),
        ("1", "\\boxed{13}", False),
    ]:
        assert grade_response(exs[sid], response) is right, (sid, response)


def test_mathvision_options_levels_subjects_and_grading():
    exs = examples("mathvision")
    assert list(exs) == ["4", "5", "6", "7", "27", "39", "49", "91", "120", "200"]
    assert all(load_image(ex.images[0]).size == (16, 16) for ex in exs.values())
    assert exs["4"].choices is None and exs["4"].question.endswith("<image1>")
    assert exs["39"].choices[:2] == ("red", "blue") and "\nChoices:\n(A) red\n(B) blue" in exs["39"].question
    assert (exs["27"].metadata["level"], exs["27"].metadata["subject"]) == (5, "topology")
    for rid, response, right in [
        ("39", "A", True),
        ("39", "<answer>red</answer>", True),
        ("39", "blue", False),
        ("120", "\\boxed{0.25}", True),
        ("120", "\\boxed{1/3}", False),
        ("5", "\\boxed{61}", True),
        ("91", "<answer>E</answer>", True),
    ]:
        assert grade_response(exs[rid], response) is right, (rid, response)


def test_wemath_parts_options_and_grading():
    exs = examples("wemath")
    assert len(exs) == 20 and list(exs)[:2] == ["2steps_1:2steps_1", "2steps_2:2steps_1"]
    assert {ex.metadata["key"] for ex in exs.values()} == {
        "2steps_1",
        "2steps_2",
        "2steps_multi",
        "3steps_1",
        "3steps_2",
        "3steps_3",
        "3steps_multi",
    }
    assert all(load_image(ex.images[0]).size == (16, 16) for ex in exs.values())
    ex = exs["2steps_2:2steps_1"]
    assert ex.choices == ("1 cm", "1.5 cm", "3.14 cm", "6.28 cm", "No correct answer") and ex.answer == "A"
    assert ex.question.endswith(
        "radius is ( ) cm.\nOptions: A. 1 cm;B. 1.5 cm;C. 3.14 cm;D. 6.28 cm; E. No correct answer"
    )
    assert grade_response(ex, "<answer>A</answer>") and grade_response(ex, "\\boxed{1 cm}")
    assert not grade_response(ex, "Answer: B")


# Which parts each fixture problem gets right (steps in order, then the whole "multi" question), worked by hand:
# 2steps_1 all right -> CM | 2steps_2 one step wrong, multi right -> RM strict, CM loose | 2steps_3 both steps
# wrong, multi right -> RM strict and loose | 2steps_4 steps right, multi wrong -> IG | 3steps_1 a step wrong,
# multi wrong -> IK | 3steps_2 all right -> CM.
WEMATH_RIGHT = {
    "2steps_1": (1, 1, 1),
    "2steps_2": (1, 0, 1),
    "2steps_3": (0, 0, 1),
    "2steps_4": (1, 1, 0),
    "3steps_1": (0, 1, 1, 0),
    "3steps_2": (1, 1, 1, 1),
}


def _wemath_right(ex) -> bool:
    part = ex.metadata["key"].split("_")[1]
    pattern = WEMATH_RIGHT[ex.metadata["ID"]]
    return bool(pattern[-1] if part == "multi" else pattern[int(part) - 1])


class CannedEngine:
    """Answers each example with the response `answers` gives its id."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    def generate(self, prompts, params):
        return [RolloutGroup(p, [Response([1], self.answers[p.example_id], "stop")]) for p in prompts]


@pytest.fixture(scope="module")
def member(tiny_zoo):
    return load_member(MemberConfig(id="qwen", model=str(tiny_zoo["qwen2_vl"]), trainable=False))


def _evaluate(member, monkeypatch, bench, exs, right_ids) -> dict:
    """`bench` on `exs` with the gold answer for `right_ids` and a non-answer otherwise."""
    answers = {
        i: f"<answer>{ex.answer}</answer>" if i in right_ids else "<answer>none</answer>" for i, ex in exs.items()
    }
    monkeypatch.setattr(scoring, "make_engine", lambda name, m: CannedEngine(answers))
    return scoring.evaluate_member(member, list(exs.values()), bench)


def test_breakdowns_by_task_skill_version_subject_and_level(member, monkeypatch):
    vista = _evaluate(member, monkeypatch, MATHVISTA, examples("mathvista"), {"1", "3", "5", "8", "13", "16"})
    assert vista["accuracy"] == pytest.approx(6 / 18)
    assert vista["by_type"] == pytest.approx(
        {
            "figure question answering": 2 / 6,
            "geometry problem solving": 2 / 3,
            "math word problem": 0.0,
            "textbook question answering": 1 / 3,
            "visual question answering": 1 / 3,
        }
    )
    assert vista["aggregate"]["by_skill"] == pytest.approx(
        {
            "algebraic reasoning": 2 / 3,
            "arithmetic reasoning": 1 / 5,
            "geometry reasoning": 2 / 3,
            "logical reasoning": 0.0,
            "numeric commonsense": 0.0,
            "scientific reasoning": 1 / 2,
            "statistical reasoning": 2 / 5,
        }
    )
    verse = _evaluate(member, monkeypatch, MATHVERSE, examples("mathverse"), {"1", "2", "6", "9", "10"})
    assert verse["by_type"] == pytest.approx(
        {"Text Dominant": 1.0, "Text Lite": 0.5, "Vision Intensive": 0.0, "Vision Dominant": 0.5, "Vision Only": 0.5}
    )
    assert verse["aggregate"]["by_subject"] == pytest.approx({"Plane Geometry": 0.6, "Solid Geometry": 0.4})
    vision = _evaluate(member, monkeypatch, MATHVISION, examples("mathvision"), {"4", "7", "6", "27", "91"})
    assert vision["by_type"] == pytest.approx(
        {"arithmetic": 0.5, "counting": 1.0, "logic": 0.5, "solid geometry": 0.0, "topology": 0.5}
    )
    assert vision["aggregate"]["by_level"] == pytest.approx({"1": 1.0, "2": 0.5, "3": 0.5, "4": 0.0, "5": 0.5})
    markdown = scoring.results_markdown({"m": {"mathvision": vision}})
    assert "- m / mathvision: by_level: 1 1.000, 2 0.500, 3 0.500, 4 0.000, 5 0.500" in markdown


def test_wemath_four_dimensions_strict_and_loose_on_a_hand_worked_example(member, monkeypatch):
    exs = examples("wemath")
    result = _evaluate(member, monkeypatch, WEMATH, exs, {i for i, ex in exs.items() if _wemath_right(ex)})
    assert result["accuracy"] == pytest.approx(14 / 20)  # 10 of 14 steps and 4 of 6 multis
    # 6 problems: IK 1 (3steps_1), IG 1 (2steps_4); strict: CM 2 (2steps_1, 3steps_2), RM 2 (2steps_2, 2steps_3);
    # loose: CM 3 (+2steps_2), RM 1 (2steps_3). RM is a share of the problems whose multi is right (CM + RM = 4).
    assert result["aggregate"]["counts"] == {
        "IK": 1,
        "IG": 1,
        "CM_strict": 2,
        "RM_strict": 2,
        "CM_loose": 3,
        "RM_loose": 1,
    }
    assert result["aggregate"]["four_dimensional"] == pytest.approx(
        {
            "problems": 6,
            "IK": 1 / 6,
            "IG": 1 / 6,
            "CM_strict": 2 / 6,
            "CM_loose": 3 / 6,
            "RM_strict": 2 / 4,
            "RM_loose": 1 / 4,
            "score_strict": (6 - 0.5 * 1 - 2 - 1) / 6,  # (N - IG/2 - RM - IK) / N = 0.4167
            "score_loose": (6 - 0.5 * 1 - 1 - 1) / 6,
        }
    )  # 0.5833
    # S1: 10 of the 14 steps right; S2: 3 of 4 two-step multis; S3: 1 of 2 three-step multis.
    assert result["aggregate"]["steps"] == pytest.approx({"S1": 10 / 14, "S2": 3 / 4, "S3": 1 / 2})
    # A problem with a part left out (a --limit cut) is not scored: without 2steps_4's multi, IG is gone.
    records = [r for r in result["records"] if r["id"] != "2steps_4:2steps_multi"]
    partial = four_dimensional(records, list(exs.values()))
    assert partial["four_dimensional"]["problems"] == 5 and partial["counts"]["IG"] == 0


def _copy(name: str, tmp_path: Path, edit) -> Path:
    """The fixture's data file, edited by `edit(rows)`, in tmp_path (images are left out: not needed)."""
    file = next((FIXTURES / name).glob(f"{SPLITS[name]}.json*"))
    text = file.read_text()
    rows = [json.loads(line) for line in text.splitlines()] if file.suffix == ".jsonl" else json.loads(text)
    edit(rows)
    out = tmp_path / file.name
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n" if file.suffix == ".jsonl" else json.dumps(rows))
    return out


def test_malformed_records_are_counted_skips(tmp_path):
    def bad_types(rows):
        rows["1"]["answer_type"] = "number"
        rows["3"]["choices"] = None
        rows["5"]["answer"] = "98"  # none of its choices

    def bad_option(rows):
        rows[0]["option"] = "300 or 400"
        rows[1]["key"] = "2steps"

    cases = [
        ("mathvista", bad_types, {"bad_record": 3}),
        ("mathverse", lambda rows: rows[0].update(question_type="essay"), {"bad_record": 1}),
        ("mathvision", lambda rows: rows[2].update(answer="F"), {"bad_record": 1}),
        ("wemath", bad_option, {"bad_record": 2}),
    ]
    for name, edit, skipped in cases:
        (tmp_path / name).mkdir()
        report = load_examples(
            name, _copy(name, tmp_path / name, edit), split=SPLITS[name], image_root=FIXTURES / name
        ).report
        assert report.skipped == skipped, (name, report.summary())
    lines = (FIXTURES / "mathvision" / "test.jsonl").read_text().splitlines()
    (tmp_path / "broken.jsonl").write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    report = load_examples("mathvision", tmp_path / "broken.jsonl", image_root=FIXTURES / "mathvision").report
    assert report.kept == 2 and report.skipped == {"undecodable_line": 1}
    assert "broken.jsonl:2" in report.samples["undecodable_line"][0]


def test_missing_data_and_unreachable_hub_name_what_to_do(tiny_zoo, tmp_path, capsys, monkeypatch):
    with pytest.raises(DataError, match="nope does not exist"):
        load_examples("wemath", tmp_path / "nope")
    (tmp_path / "testmini.json").write_text('{"not": "records"')
    with pytest.raises(DataError, match="testmini.json is not valid JSON"):
        load_examples("mathverse", tmp_path, split="testmini")
    (tmp_path / "images").mkdir()
    with pytest.raises(DataError, match="images holds neither testmini.json / testmini.jsonl"):
        load_examples("mathvista", tmp_path / "images", split="testmini")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(
        DataError,
        match=r"cannot load AI4Math/MathVista from the Hugging Face hub .*"
        r"--data mathvista=PATH",
    ):
        load_examples("mathvista", None, split="testmini")
    code = cli.run(
        ev.main,
        [
            "--models",
            str(tiny_zoo["qwen2_vl"]),
            "--benchmarks",
            "mathvision",
            "--data",
            f"mathvision={tmp_path / 'none'}",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path / 'none'} does not exist" in err and "Traceback" not in err


def test_mathvista_through_python_m_vlm_corl_eval(tiny_zoo, tmp_path):
    model = str(tiny_zoo["qwen2_vl"])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlm_corl.eval",
            "--models",
            model,
            "--benchmarks",
            "mathvista",
            "--limit",
            "4",
            "--data",
            f"mathvista={FIXTURES / 'mathvista'}",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())[model]["mathvista"]
    assert result["n"] == 4 and [r["id"] for r in result["records"]] == ["1", "2", "3", "4"]
    assert result["decoding"]["temperature"] == 0.0 and set(result["aggregate"]) == {"by_skill"}
    assert set(result["by_type"]) == {
        "textbook question answering",
        "visual question answering",
        "geometry problem solving",
        "math word problem",
    }
    assert f"- {model} / mathvista: by_skill: " in (tmp_path / "results.md").read_text()

"""CHAMP read from the installed champ-dataset package (real data, offline): every problem, known answers, the
rewrites to a comparable form and how predictions grade against them."""

import pytest

from text_corl.data import champ_answer
from vlm_corl.data.answers import normalize_answer
from vlm_corl.data.answers.normalize import is_word_answer
from vlm_corl.data.loaders import DataError, load_examples
from vlm_corl.evaluation.scoring import grade_answer
from vlm_corl.registry import BENCHMARKS


@pytest.fixture(scope="module")
def champ():
    return {e.id: e for e in load_examples("champ", split="test").examples}


def test_all_270_problems_with_their_categories(champ):
    assert len(champ) == 270
    counts = {}
    for e in champ.values():
        counts[e.metadata["category"]] = counts.get(e.metadata["category"], 0) + 1
    assert counts == {"Combinatorics": 40, "Inequality": 50, "Number-Theory": 80, "Polynomial": 50, "Sequence": 50}
    first = champ["P_Combinatorics_1"]
    assert first.question.startswith("Let a string consist of digit 1, 2, 3.") and first.answer == "239"
    assert "@@" not in "".join(e.question + e.answer for e in champ.values())  # the package's markup is removed
    assert sum(is_word_answer(normalize_answer(e.answer)) for e in champ.values()) == 56  # compared as text


@pytest.mark.parametrize(
    "raw, gold",
    [
        ("C(10, 5), or equivalently 252", "252"),
        ("5/14, or approximately 35.7%", "5/14"),
        ("100 (i.e., all values)", "100"),
        ("At most 0 values (i.e., no such values)", "0"),
        ("The limit exists and is equal to 2/3", "2/3"),
        ("-3 is the only possible value", "-3"),
        ("98 values", "98"),
        ("((-1)^(n+1)+n+1)/(n+2) (i.e., 1 if for odd n, and n/(n+2) for even n)", "((-1)^(n+1)+n+1)/(n+2)"),
        ("(x=8, y=2), (x=2, y=8)", "(x=8, y=2), (x=2, y=8)"),  # a trailing parenthesis that is part of the answer
        ("No integer solutions", "No integer solutions"),
    ],
)
def test_answers_rewritten_to_a_comparable_form(raw, gold):
    assert champ_answer(raw) == gold


def test_predictions_grade_against_the_gold(champ):
    assert champ["P_Combinatorics_2"].metadata["raw_answer"] == "C(10, 5), or equivalently 252"
    assert grade_answer(champ["P_Combinatorics_2"].answer, "252", None, "expression")
    assert grade_answer(champ["P_Sequence_29"].answer, "\\frac{2}{3}", None, "expression")
    assert not grade_answer(champ["P_Sequence_29"].answer, "\\frac{3}{2}", None, "expression")
    assert grade_answer(champ["P_Number-Theory_7"].answer, "no integer solutions", None, "expression")


def test_benchmark_and_a_path_given_by_mistake():
    bench = BENCHMARKS.get("champ")
    assert (bench.loader, bench.split, bench.temperature, bench.top_p, bench.category) == (
        "champ",
        "test",
        0.6,
        0.95,
        "category",
    )
    with pytest.raises(DataError, match="reads the installed champ-dataset package"):
        load_examples("champ", "data/champ", split="test")

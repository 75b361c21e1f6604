"""The example record: views, immutability."""

import dataclasses

import pytest

from vlm_corl.data.records import Example, ViewError, parse_view


def test_views_pick_the_original_or_the_kth_paraphrase():
    ex = Example(id="q1", question="What is 2+2?", paraphrases=("Compute 2+2.", "Add two and two."))
    assert ex.question_for("original") == "What is 2+2?"
    assert ex.question_for("paraphrase:1") == "Compute 2+2."
    assert ex.question_for("paraphrase:2") == "Add two and two."


def test_a_missing_paraphrase_names_the_example_and_the_fix():
    ex = Example(id="q1", question="What is 2+2?", paraphrases=("Compute 2+2.",), source="toy")
    with pytest.raises(ViewError, match=r"'q1' \(toy\) has 1 paraphrase.*'paraphrase:2'.*'paraphrases' field"):
        ex.question_for("paraphrase:2")


@pytest.mark.parametrize("view", ["Original", "paraphrase", "paraphrase:0", "paraphrase:-1", "paraphrase:x", "para:1"])
def test_malformed_views_are_rejected_before_any_example(view):
    with pytest.raises(ViewError, match="use 'original' or 'paraphrase:K'"):
        parse_view(view)


def test_parse_view_numbers():
    assert parse_view("original") == 0
    assert parse_view("paraphrase:3") == 3


def test_records_are_frozen_and_hashable_despite_metadata():
    ex = Example(id="a", question="q", images=(b"\x89PNG",), metadata={"type": "yes/no"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.question = "other"
    assert ex in {ex}
    assert ex == Example(id="a", question="q", images=(b"\x89PNG",), metadata={"type": "yes/no"})
    assert ex != dataclasses.replace(ex, metadata={"type": "color"})

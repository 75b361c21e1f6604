"""All 500 real MATH-500 gold answers survive extraction, normalisation and math-verify.

Each gold must be recovered from a response that boxes it, be equivalent to trivially reformatted versions of
itself, and keep its value through ``normalize_answer`` (what the fast path and math-verify actually see).
"""

from __future__ import annotations

import json
import re

import pytest

from text_corl.data import MATH500_DIR
from vlm_corl.data.answers import answers_equivalent, grade, math_verify_equivalent, normalize_answer

MATH500 = MATH500_DIR / "test.json"


@pytest.fixture(scope="module")
def golds() -> list[str]:
    return [row["answer"] for row in json.loads(MATH500.read_text())]


def spaced(gold: str) -> str:
    """Inline math with spaces around operators: "$ x + 1 $"."""
    return "$ " + re.sub(r"\s*([+=])\s*", r" \1 ", gold) + " $"


def _toggle_sizing(gold: str) -> str:
    if "\\left" in gold:
        return re.sub(r"\\(?:left|right)(?![A-Za-z])", "", gold)
    # Every bracket gets its size command, so mixed pairs such as "(3,4]" stay balanced.
    gold = re.sub(r"(?<!\\)([(\[])", r"\\left\1", gold)
    return re.sub(r"(?<!\\)([)\]])", r"\\right\1", gold)


def resized(gold: str) -> str:
    """``\\left``/``\\right`` toggled (outside ``\\text``) and ``\\dfrac``/``\\frac`` swapped; often a no-op."""
    out = gold if re.search(r"\\(?:text|mbox)", gold) else _toggle_sizing(gold)
    return re.sub(r"\\d?frac", lambda m: "\\frac" if m.group(0) == "\\dfrac" else "\\dfrac", out)


def restyled(gold: str) -> str:
    """``resized``; where that changes nothing, an integer gains ".0" and anything else a brace group."""
    out = resized(gold)
    if out != gold:
        return out
    return gold + ".0" if re.fullmatch(r"-?\d+", gold) else "{" + gold + "}"


def test_variants_are_real_reformattings(golds):
    assert all(restyled(g) != g and spaced(g) != g for g in golds)
    assert sum(resized(g) != g for g in golds) > 80  # the toggles touch every gold that has brackets or fractions
    assert resized("\\left( 3, \\frac{\\pi}{2} \\right)") == "( 3, \\dfrac{\\pi}{2} )"
    assert resized("(3,4]") == "\\left(3,4\\right]"
    assert restyled("9") == "9.0" and restyled("p - q") == "{p - q}"
    assert spaced("x=5") == "$ x = 5 $"


def test_every_gold_is_graded_correct_when_boxed(golds):
    failures = [g for g in golds if not grade(f"We simplify step by step, so the answer is \\boxed{{{g}}}.", g)]
    assert failures == []


@pytest.mark.parametrize("variant", [spaced, restyled])
def test_every_gold_equals_its_reformatting(golds, variant):
    failures = [(g, variant(g)) for g in golds if not answers_equivalent(g, variant(g))]
    assert failures == []


def test_math_verify_agrees_on_every_resizing(golds):
    # The fast path hides math-verify's view: ask math-verify itself, on the raw strings. (Not on the brace
    # groups of ``restyled``: raw math-verify reads "{58,500}" as a set; normalisation strips those braces.)
    failures = [g for g in golds if resized(g) != g and not math_verify_equivalent(g, resized(g))]
    assert failures == []


def test_normalisation_keeps_every_gold_value(golds):
    # What the fast path compares and math-verify parses is the normalised form: it must mean the gold.
    failures = [(g, normalize_answer(g)) for g in golds if not math_verify_equivalent(g, normalize_answer(g))]
    assert failures == []

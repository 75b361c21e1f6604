"""Answer extraction and equivalence, the one definition shared by rewards, voting and evaluation.

``extract_answer`` finds the final answer in a response; ``answers_equivalent`` decides whether two answers
are the same (normalised strings, multiple-choice letters, then math-verify under our own deadline);
``group_equivalent`` numbers the equivalence classes that plurality voting counts (``plurality_vote``,
``consensus``); ``grade`` is both steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from .equivalence import answers_equivalent, choice_letter, group_equivalent
from .extract import STYLES, extract_answer
from .normalize import normalize_answer
from .verifier import VERIFY_TIMEOUT_S, math_verify_equivalent
from .votes import consensus, plurality_vote

__all__ = [
    "STYLES",
    "VERIFY_TIMEOUT_S",
    "answers_equivalent",
    "choice_letter",
    "consensus",
    "extract_answer",
    "grade",
    "group_equivalent",
    "math_verify_equivalent",
    "normalize_answer",
    "plurality_vote",
]


def grade(response_text: str, gold: str, style: str = "auto", choices: Sequence[str] | None = None) -> bool:
    """Whether the answer extracted from ``response_text`` (see ``extract_answer``) is equivalent to ``gold``."""
    return answers_equivalent(gold, extract_answer(response_text, style, choices), choices)

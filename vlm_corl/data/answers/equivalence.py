"""When two answers are the same: normalised strings, multiple-choice letters, then math-verify.

Used by rewards (response vs pseudo-label), voting (``group_equivalent``) and evaluation (response vs gold).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from functools import lru_cache

from .normalize import is_word_answer, normalize_answer
from .verifier import VERIFY_TIMEOUT_S, math_verify_equivalent

# A letter alone: "B", "(B)", "B.", "B)", "[B]", "Option B", "choice (b)".
_LETTER_ALONE = re.compile(r"(?:(?:option|choice)\s*)?[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?", re.IGNORECASE)
# A letter before the choice's text: "(B) 5", "B. 5", "B) 5", "B: 5".
_LETTER_WITH_TEXT = re.compile(r"(?:[(\[]\s*([A-Za-z])\s*[)\]]|([A-Za-z])[.:)])\s+\S.*", re.DOTALL)
# A choice that carries its own label ("A. 3", "(B) 5"), as some datasets store them.
_LABELLED_CHOICE = re.compile(r"\s*(?:\(\s*[A-Za-z]\s*\)|[A-Za-z][.:)])\s+(\S.*)", re.DOTALL)
_MARKUP = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|boxed)\s*\{([^{}]*)\}|\$|\*\*")


class _DeadlinePassed(Exception):
    """math-verify did not finish in time. Raised through the cached helpers, so the answer (False) is not
    cached: the same pair is tried again later instead of staying "not equivalent" because of machine load."""


def _plain_equivalent(gold: str, pred: str, timeout_s: float) -> bool:
    g, p = normalize_answer(gold), normalize_answer(pred)
    if not g or not p:
        return False
    if g == p:
        return True
    if is_word_answer(g) and is_word_answer(p):
        return False  # math-verify reads words as products of symbols: "east" would equal "seat"
    verdict = math_verify_equivalent(g, p, timeout_s)
    if verdict is None:
        raise _DeadlinePassed
    return verdict


def _letter_form(answer: str, n_choices: int) -> tuple[str, bool] | None:
    """The letter an answer names ("(b) 5" -> ("B", False)) and whether it was written upper-case, if in range."""
    text = _MARKUP.sub(lambda m: m.group(1) or "", answer).strip()
    m = _LETTER_ALONE.fullmatch(text) or _LETTER_WITH_TEXT.fullmatch(text)
    if m is None:
        return None
    letter = m.group(1) or m.group(2)
    index = string.ascii_uppercase.index(letter.upper())
    return (letter.upper(), letter.isupper()) if index < n_choices else None


@lru_cache(maxsize=1 << 16)
def _choice_letter(answer: str, choices: tuple[str, ...], timeout_s: float) -> str | None:
    named = _letter_form(answer, len(choices))
    if named is not None and named[1]:
        return named[0]
    # A choice's own text beats a lower-case letter: with choices ("a", "b"), "b" is the text of choice B.
    for i, choice in enumerate(choices):
        labelled = _LABELLED_CHOICE.fullmatch(choice)
        if _plain_equivalent(labelled.group(1) if labelled else choice, answer, timeout_s):
            return string.ascii_uppercase[i]
    return None if named is None else named[0]


def choice_letter(answer: str, choices: Sequence[str], timeout_s: float = VERIFY_TIMEOUT_S) -> str | None:
    """The canonical form of a multiple-choice answer: the upper-case letter of its choice, or None.

    ``choices[0]`` is "A", ``choices[1]`` is "B", and so on. An answer names a choice by letter ("B", "(B)",
    "B.", "Option B", "(B) 5"; a letter past the last choice names nothing) or by an answer equivalent to the
    choice's text ("5" for choice "5 cm", "0.5" for choice ``\\frac{1}{2}``; the first such choice wins; a label
    the choice itself carries, as in "A. 3", is not part of its text).
    """
    try:
        return _choice_letter(answer, tuple(choices), timeout_s)
    except _DeadlinePassed:
        named = _letter_form(answer, len(choices))  # what is known without math-verify
        return None if named is None else named[0]


@lru_cache(maxsize=1 << 16)
def _equivalent(gold: str, pred: str, choices: tuple[str, ...] | None, timeout_s: float) -> bool:
    if choices:
        gold_letter = _choice_letter(gold, choices, timeout_s)
        pred_letter = _choice_letter(pred, choices, timeout_s)
        if gold_letter is not None and pred_letter is not None:
            return gold_letter == pred_letter
    return _plain_equivalent(gold, pred, timeout_s)


def answers_equivalent(
    gold: str | None,
    pred: str | None,
    choices: Sequence[str] | None = None,
    *,
    timeout_s: float = VERIFY_TIMEOUT_S,
) -> bool:
    """Whether ``pred`` is the same answer as ``gold`` (a gold label, a pseudo-label or a class representative).

    None on either side is never equivalent. With ``choices``, two answers that both name a choice (by letter
    or by text, see ``choice_letter``) are equal when they name the same one. Otherwise: equal normalised
    strings (``normalize_answer``) are equivalent; two plain-word answers are compared only that way; anything
    else goes to math-verify, ``verify(parse(gold), parse(pred))`` with gold first, which handles fractions vs
    decimals, sets, tuples, intervals, matrices and equations. If math-verify does not finish within
    ``timeout_s`` seconds, the answer is the normalised comparison (False), and that answer is not cached.
    Other results are cached on the arguments; safe in threads and worker processes.
    """
    if gold is None or pred is None:
        return False
    try:
        return _equivalent(gold, pred, tuple(choices) if choices else None, timeout_s)
    except _DeadlinePassed:  # the normalised comparison has already said no; not cached
        return False


def group_equivalent(
    answers: Sequence[str | None],
    choices: Sequence[str] | None = None,
    *,
    timeout_s: float = VERIFY_TIMEOUT_S,
) -> list[int | None]:
    """Equivalence-class id of each answer (None for None), classes numbered 0, 1, ... by first appearance.

    Each answer joins the first class whose representative (its first member) it is equivalent to, with the
    representative in the gold position; otherwise it opens a new class. Plurality voting counts these ids.
    """
    representatives: list[str] = []
    ids: list[int | None] = []
    for answer in answers:
        if answer is None:
            ids.append(None)
            continue
        for class_id, representative in enumerate(representatives):
            if answers_equivalent(representative, answer, choices, timeout_s=timeout_s):
                ids.append(class_id)
                break
        else:
            ids.append(len(representatives))
            representatives.append(answer)
    return ids

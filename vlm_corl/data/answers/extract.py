"""The final answer of a model response: last ``\\boxed{}``, ``<answer>`` tags, "the answer is ..." phrases."""

from __future__ import annotations

import re
from collections.abc import Sequence

from .equivalence import choice_letter
from .normalize import closing_brace

STYLES = ("auto", "boxed", "answer_tags")

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
# "The answer is X", "the final answer is: X", "Final answer: X", "Answer = X"; X runs to the end of the line.
# Only the phrase is matched: its answer is read from the last one, so a later phrase on the same line ("The
# answer is 3. Wait, I made an error. The final answer is 4.") is not swallowed by an earlier one's answer.
_PHRASE = re.compile(r"\b(?:the\s+)?(?:final\s+)?answer\s*(?:is\b\s*:?|:|=)[ \t]*", re.IGNORECASE)
_SHORT_REPLY = re.compile(r"[^\n]{1,20}")
_MATH_SPAN = re.compile(r"\$\$([^$]+)\$\$|\$([^$]+)\$|\\\(((?:(?!\\\)).)+)\\\)|\\\[((?:(?!\\\]).)+)\\\]", re.DOTALL)


def _clean(s: str | None) -> str | None:
    """Strip whitespace and wrapping math delimiters; None when nothing is left."""
    if s is None:
        return None
    s = s.strip()
    m = _MATH_SPAN.fullmatch(s)
    if m is not None:
        s = next(g for g in m.groups() if g is not None).strip()
    return s or None


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (nested braces), or of ``\\boxed 5``.

    A last box that never closes (a truncated response) gives None rather than an earlier box: the model
    had not finished answering.
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end() :].lstrip()
    if rest.startswith("{"):
        end = closing_brace(rest, 0)
        return None if end is None else _clean(rest[1:end])
    m = re.match(r"[^\s$]+", rest)
    return None if m is None else _clean(m.group(0))


def _tagged(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``; if it holds a ``\\boxed{}``, the boxed part."""
    matches = _ANSWER_TAGS.findall(text)
    if not matches:
        return None
    content = matches[-1]
    return _last_boxed(content) if _BOX.search(content) else _clean(content)


def _phrased(text: str) -> str | None:
    """The answer after the last "the answer is" / "final answer:" phrase, up to a full stop or the line end."""
    text = text.replace("**", "")  # markdown bold: "**Final Answer:** 5"
    phrases = list(_PHRASE.finditer(text))
    if not phrases:
        return None
    tail = text[phrases[-1].end() :].split("\n", 1)[0].strip()
    math = _MATH_SPAN.search(tail)
    if math is not None and math.start() == 0:
        return _clean(math.group(0))
    # A full stop ends the sentence; a point inside a number ("3.5") does not.
    return _clean(re.split(r"\.(?:\s|$)", tail, maxsplit=1)[0])


def extract_answer(text: str, style: str = "auto", choices: Sequence[str] | None = None) -> str | None:
    """The final answer of a response, or None when there is none.

    ``style``: "boxed" (the last ``\\boxed{}`` or ``\\fbox{}``), "answer_tags" (the last ``<answer>...</answer>``,
    narrowed to its ``\\boxed{}`` if it has one) or "auto" (answer tags, else the last box, else the last
    "the answer is ..." / "final answer: ..." phrase). Surrounding whitespace and ``$...$`` are stripped; an
    empty answer is None.

    With ``choices`` (multiple choice), the answer is returned in its canonical form, the upper-case letter of
    the choice it names by letter or by text (see ``choice_letter``), and an answer that names no choice is
    None. In "auto" style a multiple-choice response that is one short line ("B", "(B)", "Option B", "5 cm")
    counts as a whole, as terse models answer that way.
    """
    if style not in STYLES:
        raise ValueError(f"unknown answer style {style!r}; use one of {', '.join(STYLES)}")
    if style == "boxed":
        answer = _last_boxed(text)
    elif style == "answer_tags":
        answer = _tagged(text)
    else:
        answer = _tagged(text) or _last_boxed(text) or _phrased(text)
        if answer is None and choices and _SHORT_REPLY.fullmatch(text.strip()):
            answer = _clean(text)
    if answer is None or not choices:
        return answer
    return choice_letter(answer, choices)

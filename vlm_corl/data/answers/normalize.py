"""Canonical string form of an answer: the fast path and the fallback of answer equivalence.

Normalisation only removes notation that never changes a value (math delimiters, spacing commands,
``\\left``/``\\right``, ``\\text{}`` wrappers, thousands separators, trailing zeros of decimals), plus three
deliberate choices that make more answers equal than strict mathematics would:

- **percent signs are dropped**: ``50\\%`` -> ``50``, so "50%" equals "50" (but not "0.5");
- **degree marks are dropped**: ``90^\\circ`` and "90 degrees" -> ``90`` (but not ``\\frac{\\pi}{2}``);
- **a trailing unit after a number is dropped** (``_UNITS``): "3 cm", ``3\\text{ cm}``, "864 inches^2",
  "1000 dollars", ``\\$1000`` -> the number. Single-letter units ("m", "g") are kept: they read as variables.

Plain-word answers (letters, spaces, hyphens, at least one word of two letters or more) are lower-cased:
"Yes." -> "yes", ``\\text{Evelyn}`` -> "evelyn".
"""

from __future__ import annotations

import re

# Wrappers whose content is the answer; \boxed is here so that a gold written as "\boxed{5}" matches "5".
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|boxed|fbox)\s*\{")
_SIZED_DELIMITER = re.compile(r"\\(?:left|right|[Bb]igg?[lr]?)(?:\.|(?![A-Za-z]))")
# Group 1 is a row break "\\", matched first so that its second backslash is not read as "\ ".
_SPACING = re.compile(r"(\\\\)|\\[,;: ]|\\q?quad(?![A-Za-z])|~")
_DEGREES = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])|°")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"(-?)(\d*)\.(\d+)")
_WORDS = re.compile(r"[A-Za-z]+(?:[ \-'][A-Za-z]+)*")
_UNIT_NAMES = (
    "mm|cm|km|millimeters?|centimeters?|meters?|metres?|kilometers?|inch|inches|ft|feet|foot|yards?|yd|"
    "miles?|mph|units?|seconds?|sec|minutes?|min|hours?|hrs?|days?|weeks?|months?|years?|"
    "dollars?|cents?|degrees?|radians?|grams?|kg|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|gallons?"
)
# A unit must follow the number (digit, closing brace or space), so "2x" or "\pi r" keep their letters.
_UNITS = re.compile(rf"(?<=[\d}}\s])\s*(?:(?:square|sq\.?|cubic)\s+)?(?:{_UNIT_NAMES})(?:\^\s*\{{?[23]\}}?)?$")
# One whitespace run, optionally after a control word; the space survives only where it ends "\pi r".
_SPACE = re.compile(r"(\\[A-Za-z]+)?\s+(?=([A-Za-z])?)")


def closing_brace(s: str, open_index: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``open_index`` (escaped ``\\{``/``\\}`` do not count), or None."""
    depth = 0
    i = open_index
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2  # skip the escaped character, so "\{" and "\}" are literal braces
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _unwrap(s: str) -> str:
    """Replace every ``\\text{X}``-like wrapper by X (innermost last, so nested wrappers all go)."""
    while (m := _WRAPPER.search(s)) is not None:
        end = closing_brace(s, m.end() - 1)
        if end is None:
            return s  # unbalanced: leave it for math-verify to reject
        s = s[: m.start()] + s[m.end() : end] + s[end + 1 :]
    return s


def _strip_outer_braces(s: str) -> str:
    while s.startswith("{") and closing_brace(s, 0) == len(s) - 1:
        s = s[1:-1]
    return s


def _space(m: re.Match) -> str:
    command, next_letter = m.group(1), m.group(2)
    if command is None:
        return ""
    return command + " " if next_letter else command


def is_word_answer(s: str) -> bool:
    """True for plain-word answers ("yes", "east", "Evelyn"): letters only, one word of two letters or more.

    Math-verify reads such words as products of symbols ("east" equals "seat"), so they are compared as text.
    """
    return _WORDS.fullmatch(s) is not None and max(len(w) for w in re.split(r"[ \-']", s)) >= 2


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer (see the module docstring for what is removed and why).

    ``normalize_answer(a) == normalize_answer(b)`` implies that a and b are the same answer; the converse is
    math-verify's job.
    """
    s = s.strip().replace("\\$", "").replace("$", "")
    if (s.startswith("\\(") and s.endswith("\\)")) or (s.startswith("\\[") and s.endswith("\\]")):
        s = s[2:-2]
    s = _strip_outer_braces(_unwrap(s).strip())
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\displaystyle", "")
    s = _SIZED_DELIMITER.sub("", s)
    s = re.sub(r"(?<!\\)\\!\s*", "", s)  # negative thin space, as in "10,\!080"
    s = _SPACING.sub(lambda m: m.group(1) or " ", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\s*\.?\s*$", "", s)  # trailing full stop
    if re.search(r"\d", s):
        s = _UNITS.sub("", s)
    s = s.strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if is_word_answer(s):
        return " ".join(re.split(r"\s+", s.lower()))
    s = _strip_outer_braces(_SPACE.sub(_space, s))
    if (m := _DECIMAL.fullmatch(s)) is not None:
        sign, whole, fraction = m.groups()
        fraction = fraction.rstrip("0")
        s = sign + (whole or "0") + ("." + fraction if fraction else "")
        if s == "-0":
            s = "0"
    return s

"""Paraphrase caches: the file format, loading one onto examples, and the checks a model-written wording passes.

A *paraphrase cache* is a JSONL file with one object per example, aligned with its dataset by example id
(`python -m data_tools.paraphrase` writes one; `data.paraphrases` names one for training):

    {"id": "test/algebra/2584.json",            # the example id, as the dataset's loader gives it
     "source_question": "If $f(x) = ...",        # the question the paraphrases reword (checked when applied)
     "paraphrases": ["Let $f(x) = ...", ...],    # kept wordings, best first (possibly none)
     "rewriter": "models/Qwen3-8B",              # the model that wrote them
     "prompt": "Rewrite the question ...",       # the prompt template it was given ("{question}" marks the slot)
     ...}                                        # anything else (sampling settings, drop counts) is kept as metadata

Images are never part of a cache: a paraphrase changes only the text, and the example keeps its images.

`apply_paraphrases` *replaces* every example's own paraphrases with its cache entry's (an example with no
usable entry gets none), so that view "paraphrase:K" means the cache's K-th wording for every example rather
than a mix of two sources; `data.view_fallback` then decides what a member sees when its view is missing.

A rewriter's response must be exactly one `<paraphrase>…</paraphrase>` block (after an optional leading
`<think>…</think>`); `check_paraphrase` then rejects a wording that is empty, identical to its source, changes
any number, any `[asy]` diagram or any answer option, or is far shorter or longer than the source. Every
rejection carries a reason key (`PARSE_FAILURES`, `CHECK_FAILURES`) so drops can be counted by reason.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vlm_corl.data.loaders import DataError
from vlm_corl.data.records import Example

OPEN_TAG, CLOSE_TAG = "<paraphrase>", "</paraphrase>"

PARSE_FAILURES = {
    "no_block": f"the response has no {OPEN_TAG} tag",
    "unclosed_block": f"{OPEN_TAG} is never closed by {CLOSE_TAG}",
    "multiple_blocks": f"more than one {OPEN_TAG} or {CLOSE_TAG} tag",
    "text_outside_block": "text other than whitespace (or one leading <think> block) outside the block",
    "truncated": "the response hit the token limit before closing its block (raise --max-new-tokens)",
}
CHECK_FAILURES = {
    "empty": "the block holds no text",
    "identical": "the same as the source question after normalisation (case, spacing, final punctuation)",
    "numbers_changed": "the multiset of numbers differs from the source's (one changed, dropped or added)",
    "diagram_changed": "an [asy]...[/asy] diagram of the source is not reproduced verbatim and in order",
    "options_changed": "an answer option of the source is not reproduced verbatim and in order",
    "too_short": "shorter than MIN_LENGTH_RATIO x the source's prose (diagrams excluded)",
    "too_long": "longer than MAX_LENGTH_RATIO x the source's prose (diagrams excluded)",
    "duplicate": "the same as a wording already kept for this example (after normalisation)",
}

MIN_LENGTH_RATIO = 0.5
MAX_LENGTH_RATIO = 3.0

SAMPLES_PER_REASON = 5
"""How many example ids an `ApplyReport` names per reason (all of them are counted)."""

_THINK = re.compile(r"\s*<think>.*?</think>", re.DOTALL)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_DIAGRAM = re.compile(r"\[asy\].*?\[/asy\]", re.DOTALL)
# Option markers: "(A)" anywhere, or "A." / "A)" / "A:" at the start of a line.
_PAREN_MARKER = re.compile(r"\(([A-Z])\)")
_LINE_MARKER = re.compile(r"(?m)^[ \t]*([A-Z])[.):][ \t]")


class CacheError(DataError):
    """A paraphrase cache that cannot be read; the message names the file (and line) and what is wrong."""


# ---------------------------------------------------------------------------------------------------------
# The cache file.


@dataclass(frozen=True)
class CacheRecord:
    """One line of a paraphrase cache (see the module docstring)."""

    id: str
    source_question: str
    paraphrases: tuple[str, ...]
    rewriter: str
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    """Every other field of the line (sampling settings, drop counts, ...)."""

    def to_json(self) -> str:
        """The record as one JSONL line (no trailing newline)."""
        return json.dumps(
            {
                "id": self.id,
                "source_question": self.source_question,
                "paraphrases": list(self.paraphrases),
                "rewriter": self.rewriter,
                "prompt": self.prompt,
                **self.metadata,
            },
            ensure_ascii=False,
        )


_REQUIRED = {"id": str, "source_question": str, "paraphrases": list, "rewriter": str, "prompt": str}


def read_cache(path: str | os.PathLike) -> dict[str, CacheRecord]:
    """The records of a paraphrase cache by example id, in file order. Blank lines are ignored.

    Raises CacheError naming the file and line for a missing file, a line that is not a JSON object, a
    missing or mistyped field (`_REQUIRED`; every paraphrase a string), or an id seen on an earlier line.
    """
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise CacheError(
            f"cannot read paraphrase cache {path}: {e.strerror or e}; check data.paraphrases "
            f"(relative paths are from {Path.cwd()})"
        ) from e
    records: dict[str, CacheRecord] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise CacheError(
                f"{where}: not a JSON object ({e}); a paraphrase cache has one object per line, "
                f"as written by corl paraphrase"
            ) from e
        if not isinstance(row, dict):
            raise CacheError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for name, kind in _REQUIRED.items():
            if name not in row:
                raise CacheError(f"{where}: no {name!r} field (a cache line needs {', '.join(_REQUIRED)})")
            if not isinstance(row[name], kind):
                raise CacheError(f"{where}: {name!r} must be a {kind.__name__}, got {type(row[name]).__name__}")
        if not all(isinstance(p, str) for p in row["paraphrases"]):
            raise CacheError(f"{where}: every entry of 'paraphrases' must be a string")
        if row["id"] in records:
            raise CacheError(f"{where}: id {row['id']!r} already appears on line {first_line[row['id']]}")
        first_line[row["id"]] = number
        records[row["id"]] = CacheRecord(
            id=row["id"],
            source_question=row["source_question"],
            paraphrases=tuple(row["paraphrases"]),
            rewriter=row["rewriter"],
            prompt=row["prompt"],
            metadata={k: v for k, v in row.items() if k not in _REQUIRED},
        )
    return records


@dataclass
class ApplyReport:
    """What `apply_paraphrases` did: examples that got cache wordings, and those that got none, by reason."""

    examples: int = 0
    applied: int = 0
    """Examples whose paraphrases now come from the cache (possibly zero of them, if the rewriter kept none)."""
    missing: int = 0
    """Examples with no cache entry: they now have no paraphrases."""
    stale: int = 0
    """Examples whose cache entry rewords another question (source_question differs): no paraphrases."""
    unused: int = 0
    """Cache entries whose id is not among the examples (normal when the data is limited or split)."""
    counts: dict[int, int] = field(default_factory=dict)
    """Number of paraphrases -> examples with that many, after applying."""
    samples: dict[str, list[str]] = field(default_factory=dict)
    """"missing" / "stale" -> the first `SAMPLES_PER_REASON` example ids."""

    def short_of(self, k: int) -> int:
        """Examples with fewer than k paraphrases, i.e. without view "paraphrase:k"."""
        return sum(n for count, n in self.counts.items() if count < k)

    def summary(self) -> str:
        """One line of totals, then the first ids of each kind of example that got no cache wordings."""
        lines = [
            f"paraphrase cache: {self.applied}/{self.examples} examples applied, {self.missing} missing, "
            f"{self.stale} stale, {self.unused} unused cache entries; paraphrases per example: "
            + ", ".join(f"{k}: {n}" for k, n in sorted(self.counts.items()))
        ]
        lines += [f"  {reason}: e.g. {', '.join(ids)}" for reason, ids in self.samples.items()]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form for run logs."""
        return {
            "examples": self.examples,
            "applied": self.applied,
            "missing": self.missing,
            "stale": self.stale,
            "unused": self.unused,
            "counts": {str(k): n for k, n in sorted(self.counts.items())},
            "samples": {reason: list(ids) for reason, ids in self.samples.items()},
        }

    def _note(self, reason: str, example_id: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        ids = self.samples.setdefault(reason, [])
        if len(ids) < SAMPLES_PER_REASON:
            ids.append(example_id)


def apply_paraphrases(examples: Sequence[Example], cache: dict[str, CacheRecord]) -> tuple[list[Example], ApplyReport]:
    """Each example with its paraphrases replaced by its cache entry's (see the module docstring).

    An example whose id has no entry ("missing"), or whose entry's source_question is not its question
    ("stale": the dataset changed under the same id), gets no paraphrases; both are counted and sampled.
    """
    report = ApplyReport(examples=len(examples))
    out = []
    for ex in examples:
        record = cache.get(ex.id)
        if record is None:
            report._note("missing", ex.id)
            paraphrases: tuple[str, ...] = ()
        elif record.source_question != ex.question:
            report._note("stale", ex.id)
            paraphrases = ()
        else:
            report.applied += 1
            paraphrases = record.paraphrases
        report.counts[len(paraphrases)] = report.counts.get(len(paraphrases), 0) + 1
        out.append(replace(ex, paraphrases=paraphrases))
    report.unused = len(set(cache) - {ex.id for ex in examples})
    return out, report


# ---------------------------------------------------------------------------------------------------------
# A rewriter's response: parsing and checking.


class ParaphraseRejected(ValueError):
    """A response or a wording that fails; `reason` is a key of PARSE_FAILURES or CHECK_FAILURES."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}: {PARSE_FAILURES.get(reason) or CHECK_FAILURES[reason]}")
        self.reason = reason


def parse_response(text: str, truncated: bool = False) -> str:
    """The stripped text of the response's one `<paraphrase>` block.

    Accepted: optional whitespace, optionally one `<think>…</think>` block, the paraphrase block, optional
    whitespace; nothing else. `truncated` (the response hit the token limit) turns a missing closing tag into
    "truncated". Raises ParaphraseRejected with a PARSE_FAILURES reason.
    """
    think = _THINK.match(text)
    body = text[think.end() :] if think else text
    opens, closes = body.count(OPEN_TAG), body.count(CLOSE_TAG)
    if opens > 1 or closes > 1:
        raise ParaphraseRejected("multiple_blocks")
    if closes == 0 and truncated:
        raise ParaphraseRejected("truncated")
    if opens == 0:
        raise ParaphraseRejected("no_block")
    if closes == 0:
        raise ParaphraseRejected("unclosed_block")
    before, _, rest = body.partition(OPEN_TAG)
    inside, _, after = rest.partition(CLOSE_TAG)
    if before.strip() or after.strip():
        raise ParaphraseRejected("text_outside_block")
    return inside.strip()


def normalize_text(text: str) -> str:
    """Case-folded, whitespace collapsed, final punctuation dropped: what "identical" and "duplicate" compare."""
    return re.sub(r"\s+", " ", text).strip().casefold().rstrip(".?!;: ")


def numbers(text: str) -> Counter:
    """The multiset of numbers written in digits ("3", "0.5"; "1,000" is 1 and 000; signs are not kept)."""
    return Counter(_NUMBER.findall(text))


def diagrams(text: str) -> list[str]:
    """The `[asy]…[/asy]` blocks (MATH's Asymptote figures), in order."""
    return _DIAGRAM.findall(text)


def answer_options(question: str, choices: Sequence[str] | None = None) -> list[str]:
    """The answer options written in the question, in order, as they must reappear in a paraphrase.

    Lettered options ("(A) Line (B) Circle", or lines starting "A." / "A)" / "A:") count when their letters
    run A, B, C, ... (at least two); each option is its marker and text up to the next marker or line end.
    Otherwise the example's `choices`, when every one of them is written in the question. Diagrams are
    ignored (their labels are not options).
    """
    prose = _DIAGRAM.sub("", question)
    for marker in (_PAREN_MARKER, _LINE_MARKER):
        found = [m for m in marker.finditer(prose)]
        run = []
        for m in found:
            if m.group(1) == chr(ord("A") + len(run)):
                run.append(m)
        if len(run) >= 2:
            ends = [m.start() for m in run[1:]] + [len(prose)]
            return [prose[m.start() : end].split("\n")[0].strip() for m, end in zip(run, ends)]
    if choices and all(c in prose for c in choices):
        return list(choices)
    return []


def _in_order(parts: Iterable[str], text: str) -> bool:
    """Whether every part occurs in text, each after the end of the previous one."""
    position = 0
    for part in parts:
        found = text.find(part, position)
        if found < 0:
            return False
        position = found + len(part)
    return True


def check_paraphrase(
    candidate: str,
    source: str,
    choices: Sequence[str] | None = None,
    kept: Sequence[str] = (),
    min_ratio: float = MIN_LENGTH_RATIO,
    max_ratio: float = MAX_LENGTH_RATIO,
) -> None:
    """Raise ParaphraseRejected (a CHECK_FAILURES reason) unless `candidate` is a usable rewording of `source`.

    `choices` are the example's options (see `answer_options`); `kept` are wordings already accepted for this
    example (a repeat is a "duplicate"). Lengths compare the prose, with diagrams removed.
    """
    if not candidate.strip():
        raise ParaphraseRejected("empty")
    if normalize_text(candidate) == normalize_text(source):
        raise ParaphraseRejected("identical")
    if numbers(candidate) != numbers(source):
        raise ParaphraseRejected("numbers_changed")
    if not _in_order(diagrams(source), candidate):
        raise ParaphraseRejected("diagram_changed")
    if not _in_order(answer_options(source, choices), candidate):
        raise ParaphraseRejected("options_changed")
    ratio = len(_DIAGRAM.sub("", candidate).strip()) / max(len(_DIAGRAM.sub("", source).strip()), 1)
    if ratio < min_ratio:
        raise ParaphraseRejected("too_short")
    if ratio > max_ratio:
        raise ParaphraseRejected("too_long")
    if normalize_text(candidate) in {normalize_text(k) for k in kept}:
        raise ParaphraseRejected("duplicate")


def select_paraphrases(
    responses: Iterable[tuple[str, bool]],
    source: str,
    n: int,
    choices: Sequence[str] | None = None,
    min_ratio: float = MIN_LENGTH_RATIO,
    max_ratio: float = MAX_LENGTH_RATIO,
) -> tuple[list[str], Counter, int]:
    """Parse and check every (response text, truncated) in order; keep the first n that pass.

    Returns (kept wordings, dropped responses by reason, surplus: responses that passed after n were kept).
    """
    kept: list[str] = []
    dropped: Counter = Counter()
    surplus = 0
    for text, truncated in responses:
        try:
            candidate = parse_response(text, truncated)
            check_paraphrase(candidate, source, choices, kept, min_ratio, max_ratio)
        except ParaphraseRejected as e:
            dropped[e.reason] += 1
            continue
        if len(kept) < n:
            kept.append(candidate)
        else:
            surplus += 1
    return kept, dropped, surplus

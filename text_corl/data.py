"""Text benchmark loaders, found by `vlm_corl.registry.LOADERS` through the `vlm_corl.loaders` entry points.

Each follows the loader contract of `vlm_corl.data.loaders` and is used through `vlm_corl.data.load_examples`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from vlm_corl.data.loaders import (
    DataError,
    Skip,
    declares_category,
    example_from_row,
    hub_dataset,
    resolve_data_file,
)
from vlm_corl.data.records import Example, with_choices

MATH500_DIR = Path(__file__).resolve().parent / "datasets" / "math500"  # vendored copy (README.md there)


@declares_category("subject")
def load_math500(path: str | os.PathLike | None, split: str = "test") -> Iterator[Example | Skip]:
    """MATH-500 as released with the Co-RL code: a JSON list of {"prompt", "answer", "source", "id"}.

    `path` is the JSON file, or a directory holding `<split>.json`; None = the copy shipped with this package
    (`text_corl/datasets/math500`). Ids are the file's own ("test/precalculus/807.json"); metadata keeps the
    row's "source" and adds "subject", the id's middle part. Text-only: no images.
    """
    file = resolve_data_file(path if path is not None else MATH500_DIR, split, (".json",), "math500")
    try:
        rows = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise DataError(
            f"cannot read {file} as JSON ({e}); MATH-500 is one JSON list of "
            f'{{"prompt", "answer", "source", "id"}} objects'
        ) from e
    if not isinstance(rows, list):
        raise DataError(f"{file} holds a JSON {type(rows).__name__}, not the list of problems MATH-500 is")
    return (_math500_example(row, index, split, file.parent) for index, row in enumerate(rows))


def _math500_example(row: object, index: int, split: str, directory: Path) -> Example | Skip:
    item = example_from_row(row, fallback_id=f"math500-{split}-{index:06d}", source="math500", image_root=directory)
    if isinstance(item, Skip):
        return item
    parts = item.id.split("/")  # "test/<subject>/<number>.json"
    return replace(item, metadata={**item.metadata, "subject": parts[1]}) if len(parts) == 3 else item


def jsonl_rows(file: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row) of a JSON Lines file (gzipped when it ends in .gz); an unreadable line becomes a
    Skip row, an unreadable file a DataError."""
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except ValueError as e:
                        yield number, Skip("bad_json", f"{file}:{number}: {e}")
    except OSError as e:
        raise DataError(f"cannot read {file}: {e}") from e


def release_rows(
    path: str | os.PathLike | None,
    split: str,
    suffixes: tuple[str, ...],
    loader: str,
    hub: tuple[str, str | None, str] | None = None,
) -> tuple[str, Iterator[tuple[int, object]]]:
    """(where, rows) of a benchmark's release: its JSON Lines file (`path`, or `path/<split><suffix>`), or, with
    no path, the `hub` dataset (name, config, split) through `vlm_corl.data.hub_dataset` where a hub can be
    reached, its rows numbered from 1. `where` names the file or dataset in skip reasons."""
    if path is None and hub is not None:
        return hub[0], enumerate(hub_dataset(*hub, loader), 1)
    file = resolve_data_file(path, split, suffixes, loader)
    return str(file), jsonl_rows(file)


def load_gsm8k(path: str | os.PathLike | None, split: str = "test") -> Iterator[Example | Skip]:
    """GSM8K as openai/grade-school-math releases it: `<split>.jsonl` of {"question", "answer"}, the answer's
    worked solution ending in "#### <number>" (without a path: openai/gsm8k "main" from the hub). The gold answer
    is that number (thousands commas removed); the solution stays in metadata["solution"]. Ids:
    gsm8k-<split>-<line>."""
    file, rows = release_rows(path, split, (".jsonl",), "gsm8k", ("openai/gsm8k", "main", split))
    for number, row in rows:
        if isinstance(row, Skip):
            yield row
            continue
        solution = row.get("answer") if isinstance(row, dict) else None
        if not isinstance(solution, str) or "####" not in solution:
            yield Skip("no_final_answer", f"{file}:{number}: the answer has no '#### <number>' line")
            continue
        final = solution.rsplit("####", 1)[1].strip().replace(",", "")
        yield Example(
            id=f"gsm8k-{split}-{number:06d}",
            question=str(row.get("question") or ""),
            answer=final,
            source="gsm8k",
            metadata={"solution": solution},
        )


def load_amc23(path: str | os.PathLike | None, split: str = "test") -> Iterator[Example | Skip]:
    """AMC 2023 (40 problems) as the math-evaluation harnesses ship it: `<split>.jsonl` of {"id", "question"
    (or "problem"), "answer"}, the answer a number that may be written as a float (27.0 -> "27")."""
    file, rows = release_rows(path, split, (".jsonl",), "amc23")
    for number, row in rows:
        if isinstance(row, Skip) or not isinstance(row, dict):
            yield row if isinstance(row, Skip) else Skip("bad_record", f"{file}:{number}: not an object")
            continue
        answer = row.get("answer")
        if isinstance(answer, float) and answer.is_integer():
            answer = int(answer)
        question = str(row.get("question") or row.get("problem") or "")
        yield Example(
            id=f"amc23-{row.get('id', number)}",
            question=question,
            answer=None if answer is None else str(answer),
            source="amc23",
            metadata={k: v for k, v in row.items() if k not in ("question", "problem", "answer")},
        )


GPQA_CHOICES_SEED = 0  # choices are shuffled per question with this seed and the question's record id


def load_gpqa(path: str | os.PathLike | None, split: str = "diamond") -> Iterator[Example | Skip]:
    """GPQA as Idavidrein/gpqa releases it: `gpqa_<split>.csv` (split: diamond, main, extended) with "Question",
    "Correct Answer", "Incorrect Answer 1..3", "Record ID", "High-level domain", "Subdomain" (without a path:
    the same columns from the hub's gated Idavidrein/gpqa, config gpqa_<split>, once its terms are accepted).
    The four options are shuffled per question by a seed made of GPQA_CHOICES_SEED and the record id (the same
    order on every run and machine); the gold answer is the correct option's letter. metadata: domain,
    subdomain."""
    import random

    for file, number, row in _gpqa_rows(path, split):
        options = [row.get("Correct Answer")] + [row.get(f"Incorrect Answer {i}") for i in (1, 2, 3)]
        if not row.get("Question") or not all(o and o.strip() for o in options):
            yield Skip("bad_record", f"{file}:{number}: a question and four answers are needed")
            continue
        record = row.get("Record ID") or f"line{number}"
        order = list(range(4))
        random.Random(f"{GPQA_CHOICES_SEED}:{record}").shuffle(order)
        choices = tuple(options[i].strip() for i in order)
        yield Example(
            id=f"gpqa-{split}-{record}",
            question=with_choices(row["Question"].strip(), choices),
            choices=choices,
            answer="ABCD"[order.index(0)],
            source="gpqa",
            metadata={"domain": row.get("High-level domain"), "subdomain": row.get("Subdomain")},
        )


def _gpqa_rows(path, split: str) -> Iterator[tuple[str, int, dict]]:
    """(where, line, row) of the GPQA CSV, or of the hub's copy when no path is given."""
    import csv

    if path is None:
        yield from (
            ("Idavidrein/gpqa", number, row)
            for number, row in enumerate(hub_dataset("Idavidrein/gpqa", f"gpqa_{split}", "train", "gpqa"), 1)
        )
        return
    if Path(path).is_dir():
        path = Path(path) / f"gpqa_{split}.csv"
    file = resolve_data_file(path, split, (".csv",), "gpqa")
    with open(file, newline="", encoding="utf-8") as f:
        yield from ((str(file), number, row) for number, row in enumerate(csv.DictReader(f), 2))  # 1: the header


# CHAMP's answers are written for a human (or GPT-4) grader: "C(10, 5), or equivalently 252", "100 (i.e., all
# values)", "The limit exists and is equal to 2/3". These rewrites keep the one form math-verify can compare
# (the explicit one of two equivalent forms, the value without its gloss or sentence); each is checked in
# tests/test_champ.py. The answer as released stays in metadata["raw_answer"].
_CHAMP_ANSWER_REWRITES = (
    (re.compile(r".+?,? or (?:equivalently|an equivalent form such as) (?P<keep>.+)"), "keep"),
    (re.compile(r"(?P<keep>.+?), or approximately .+"), "keep"),
    (re.compile(r"At most (?P<keep>\S+) .+"), "keep"),  # "At most 0 values (i.e., no such values)"
    (re.compile(r"(?P<keep>.+?) \((?:i\.e\.,|none of|no such).*\)"), "keep"),
    (re.compile(r"(?:The limit exists and is equal to|The only possible value for the limit is) (?P<keep>.+)"), "keep"),
    (re.compile(r"(?P<keep>\S+) (?:is the only possible value|values|pairs|roots|inequalities|times)"), "keep"),
)


def champ_answer(answer: str) -> str:
    """The comparable form of a CHAMP answer (see _CHAMP_ANSWER_REWRITES); free text stays as it is."""
    for pattern, group in _CHAMP_ANSWER_REWRITES:
        m = pattern.fullmatch(answer.strip())
        if m:
            return m[group]
    return answer.strip()


def load_champ(path: str | os.PathLike | None, split: str = "test") -> Iterator[Example | Skip]:
    """CHAMP (270 competition problems with final answers) from the installed champ-dataset package (v0 data).

    One split, "test". Ids are the package's ("P_Combinatorics_1"); metadata: category (Combinatorics,
    Inequality, Number-Theory, Polynomial, Sequence) and raw_answer. The gold answer is `champ_answer` of the
    released one: 56 are plain words ("No", "No integer solutions"), which vlm_corl.data.answers compares as
    normalised text; a few mix words and math ("376 and 625", "x(n)<y(n-1) for all n≥3") and go to math-verify
    as they are."""
    if path is not None:
        raise DataError(f"the 'champ' loader reads the installed champ-dataset package; give no path (got {path})")
    if split != "test":
        raise DataError(f"CHAMP has one split, 'test' (got {split!r})")
    try:
        import champ_dataset
    except ImportError as e:
        raise DataError("the 'champ' loader needs the champ-dataset package: pip install champ-dataset==1.0.0") from e
    for identifier, problem in champ_dataset.load("v0").problems.items():
        yield Example(
            id=identifier,
            question=problem.text,
            answer=champ_answer(problem.answer),
            source="champ",
            metadata={"category": problem.category, "raw_answer": problem.answer},
        )

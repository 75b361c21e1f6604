"""MathVerse (testmini: 788 problems in five versions, 3,940 records) from its official release.

Data, `--data mathverse=PATH`: the release's `testmini.json` (or its folder): a JSON list of records with
"sample_index" (the id), "problem_index", "problem_version" (Text Dominant, Text Lite, Vision Intensive, Vision
Dominant, Vision Only), "question" (multiple-choice ones end with "Choices:" and "A:…" lines; empty for Vision
Only), "image" (e.g. "images_version_1-4/image_685.png", relative to the JSON file's folder or `image_root`:
point it at where images.zip was unpacked), "answer" (a letter for multi-choice), "question_type"
(multi-choice | free-form), "metadata" {split, source, subject, subfield}, "query_wo", "query_cot",
"question_for_eval". Or the Hugging Face parquet release AI4Math/MathVerse (the picture in "image"); with no path,
`datasets.load_dataset("AI4Math/MathVerse", "testmini", split="testmini")` when the hub is reachable.

Prompt: the question as released (it lists the choices); a Vision Only record, whose question is in the picture,
asks to answer the question shown in the image. The choices are read back from the "Choices:" lines; where the
text has none (the options are drawn in the picture), they are the letters A-D (to the gold letter, if later),
so a reply that is a letter is read as one.

Grading: the official pipeline (evaluation/extract_answer_s1.py, score_answer_s2.py in
github.com/ZrrSkywalker/MathVerse) extracts and judges answers with GPT-4; its rule-only "quick match" is
exact equality of the answer and the extraction. Here: our extraction, and a letter, the option's text or an
equivalent value (`vlm_corl.data.answers`) is right. score_answer_s2.py reports accuracy overall, per
problem_version and per subject/subfield; here overall, per problem_version (`by_type`) and per subject
(`aggregate`).
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Iterator
from dataclasses import replace

from vlm_corl.data.loaders import Skip
from vlm_corl.data.records import Example
from vlm_corl.evaluation.benchmarks.common import Release, accuracy_by, grade_response, lift_metadata, release_examples
from vlm_corl.evaluation.scoring import Benchmark

QUESTION_TYPES = ("multi-choice", "free-form")
VISION_ONLY_QUESTION = "Answer the question shown in the image."
_CHOICES = re.compile(r"\bChoices\s*:\s*\n(.*)\Z", re.DOTALL | re.IGNORECASE)
_CHOICE_LINE = re.compile(r"\s*([A-Z])\s*[:.)：]\s*(.*?)\s*")
RELEASE = Release("mathverse", hub="AI4Math/MathVerse", fields={"id": "sample_index"}, hub_config="testmini")


def load_mathverse(
    path: str | os.PathLike | None, split: str = "testmini", *, image_root: str | os.PathLike | None = None
) -> Iterator[Example | Skip]:
    """MathVerse records (module doc): ids are the sample indices; metadata holds problem_version,
    question_type, problem_index and the record's metadata (subject, subfield, source) at the top level."""
    items = release_examples(RELEASE, path, split, image_root=image_root)
    return (item if isinstance(item, Skip) else _problem(item) for item in items)


def _problem(ex: Example) -> Example | Skip:
    meta = lift_metadata(ex.metadata)
    if meta.get("question_type") not in QUESTION_TYPES or not ex.answer:
        return Skip(
            "bad_record",
            f"{ex.id}: needs an answer and question_type multi-choice or free-form (got {meta.get('question_type')!r})",
        )
    question = ex.question.strip() or VISION_ONLY_QUESTION
    choices = _choices(question, ex.answer) if meta["question_type"] == "multi-choice" else None
    return replace(ex, question=question, choices=choices, metadata=meta)


def _choices(question: str, answer: str) -> tuple[str, ...]:
    """The options listed after "Choices:" (A, B, … in order), else the letters A-D (to the gold letter)."""
    block = _CHOICES.search(question)
    lines = [_CHOICE_LINE.fullmatch(line) for line in block.group(1).splitlines() if line.strip()] if block else []
    if lines and all(lines) and [m.group(1) for m in lines] == list(string.ascii_uppercase[: len(lines)]):
        return tuple(m.group(2) for m in lines)
    last = max(3, string.ascii_uppercase.find(answer.strip().upper()[:1]))
    return tuple(string.ascii_uppercase[: last + 1])


def by_subject(records: list[dict], examples: list[Example]) -> dict:
    """Accuracy per subject (Plane Geometry, Solid Geometry, Functions)."""
    return {"by_subject": accuracy_by(records, examples, "subject")}


MATHVERSE = Benchmark(
    "mathverse",
    "mathverse",
    "testmini",
    category="problem_version",
    max_new_tokens=1024,
    grade=grade_response,
    aggregate=by_subject,
)

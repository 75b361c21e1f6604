"""MATH-Vision (MathVision: test 3,040 problems, testmini 304) from its official release.

Data, `--data mathvision=PATH`: the GitHub release's `data/test.jsonl` / `data/testmini.jsonl` (or their folder):
JSON Lines of {"id", "question" (with "<image1>" marks), "options" (a list; empty for free-form), "answer" (the
option's letter when there are options), "solution", "level" (1-5), "subject", "image" ("images/4.jpg",
relative to the file's folder or `image_root`)}. Or the Hugging Face parquet release MathLLMs/MathVision (the
picture in "decoded_image"); with no path, `datasets.load_dataset("MathLLMs/MathVision", split=...)` when the
hub is reachable. The benchmark is the full test split; a file given as the path is read whole, so
`--data mathvision=data/testmini.jsonl` evaluates the 304.

Prompt: the question and its options "(A) …".

Grading, verified against evaluation/evaluate.py and utils.py (is_equal) of github.com/mathllm/MATH-V:
a response is right when its answer equals the gold letter or the gold option's text (case-insensitive,
numbers to 2 decimals, LaTeX through latex2sympy); here a letter or its option's text name the same option and
other answers are compared by `vlm_corl.data.answers` (math-verify: its own numeric tolerance, not 2-decimal
rounding). The official script reports accuracy overall, per level, per subject and per (subject, level);
here overall, per subject (`by_type`) and per level (`aggregate`).
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterator
from dataclasses import replace

from vlm_corl.data.loaders import Skip
from vlm_corl.data.records import Example, with_choices
from vlm_corl.evaluation.benchmarks.common import Release, accuracy_by, grade_response, release_examples
from vlm_corl.evaluation.scoring import Benchmark

RELEASE = Release("mathvision", hub="MathLLMs/MathVision", fields={}, dataset_fields={"images": "decoded_image"})


def load_mathvision(
    path: str | os.PathLike | None, split: str = "test", *, image_root: str | os.PathLike | None = None
) -> Iterator[Example | Skip]:
    """MATH-Vision records (module doc): ids are the release's; metadata holds level, subject and solution."""
    items = release_examples(RELEASE, path, split, image_root=image_root)
    return (item if isinstance(item, Skip) else _problem(item) for item in items)


def _problem(ex: Example) -> Example | Skip:
    choices = ex.choices or None
    if choices and ex.answer not in tuple(string.ascii_uppercase[: len(choices)]):
        return Skip(
            "bad_record", f"{ex.id}: answer {ex.answer!r} is not the letter of one of its {len(choices)} options"
        )
    return replace(ex, question=with_choices(ex.question, choices), choices=choices)


def by_level(records: list[dict], examples: list[Example]) -> dict:
    """Accuracy per difficulty level (1-5)."""
    return {"by_level": accuracy_by(records, examples, "level")}


MATHVISION = Benchmark(
    "mathvision",
    "mathvision",
    "test",
    category="subject",
    max_new_tokens=1024,
    grade=grade_response,
    aggregate=by_level,
)

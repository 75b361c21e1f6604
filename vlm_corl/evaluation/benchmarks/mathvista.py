"""MathVista (testmini: 1,000 problems) from its official release, graded by its own rules.

Data, `--data mathvista=PATH`: the GitHub release's `data/testmini.json` (or its folder): an object of records
keyed by pid, each with "pid", "question", "image" (a path such as "images/1.jpg", relative to the JSON file's
folder or `image_root`), "choices" (null for free-form), "unit", "precision", "answer", "question_type"
(multi_choice | free_form), "answer_type" (integer | float | text | list) and "metadata" {category, task,
context, grade, skills, source, language, split, img_width, img_height}. Or the Hugging Face release
AI4Math/MathVista (parquet: the same columns, the picture in "decoded_image", and "query"); with no path,
`datasets.load_dataset("AI4Math/MathVista", split="testmini")` when the hub is reachable.

Prompt: the question, "(Unit: …)" when it has a unit, its choices "(A) …", and for free-form problems the kind
of answer wanted (an integer, a number with N decimals, a Python list), as MathVista's own queries
(data/query.json) say.

Grading, verified against evaluation/calculate_score.py (normalize_extracted_answer, safe_equal) of
github.com/lupantech/MathVista at commit e999481 ("Fixed calculate_score.py"):
- multiple choice (the gold answer is the option's text): the official script turns a letter into its option's
  text and compares texts; here a letter and its option's text name the same option (`vlm_corl.data.answers`).
  The official script maps an answer that names no option to the nearest option by edit distance; here such
  an answer is wrong;
- integer: str(int(float(prediction))) == answer, so 2.7 counts as 2; the same here, compared as numbers;
- float: the prediction rounded to the problem's `precision` decimals equals the answer;
- list: the official compares the prediction's string with the answer string ("[2014, 2016]"); here the lists
  are compared element-wise, numbers by value;
- free-form text: equivalence (`vlm_corl.data.answers`);
- the problem's unit is stripped from a prediction ("11 years" -> 11) before it is read (the official
  extraction, done by GPT-4, returns the bare value).
A prediction that is no plain number (\\frac{1}{2}) is compared by math-verify instead.
The official score is accuracy, overall and by question_type, answer_type, language, source, category, task,
context, grade and skills; here overall, by task (`by_type`) and by skill (`aggregate`; a problem counts under
each of its skills, as there).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from dataclasses import replace

from vlm_corl.data.answers import answers_equivalent, extract_answer, normalize_answer
from vlm_corl.data.loaders import Skip
from vlm_corl.data.records import Example, with_choices
from vlm_corl.evaluation.benchmarks.common import Release, accuracy_by, grade_response, lift_metadata, release_examples
from vlm_corl.evaluation.scoring import Benchmark

ANSWER_TYPES = ("integer", "float", "text", "list")
RELEASE = Release(
    "mathvista", hub="AI4Math/MathVista", fields={"id": "pid"}, dataset_fields={"id": "pid", "images": "decoded_image"}
)


def load_mathvista(
    path: str | os.PathLike | None, split: str = "testmini", *, image_root: str | os.PathLike | None = None
) -> Iterator[Example | Skip]:
    """MathVista records (module doc): ids are the pids; metadata holds question_type, answer_type, unit,
    precision and the record's own metadata (task, category, skills, ...) at the top level."""
    items = release_examples(RELEASE, path, split, image_root=image_root)
    return (item if isinstance(item, Skip) else _problem(item) for item in items)


def _problem(ex: Example) -> Example | Skip:
    meta = lift_metadata(ex.metadata)
    kind, multi = meta.get("answer_type"), meta.get("question_type") == "multi_choice"
    if kind not in ANSWER_TYPES or meta.get("question_type") not in ("multi_choice", "free_form"):
        return Skip(
            "bad_record",
            f"{ex.id}: question_type {meta.get('question_type')!r} / answer_type {kind!r} "
            f"(expected multi_choice|free_form / {'|'.join(ANSWER_TYPES)})",
        )
    if multi and (not ex.choices or ex.answer not in ex.choices):
        return Skip(
            "bad_record", f"{ex.id}: a multi_choice answer is one of its choices (got {ex.answer!r}, {ex.choices!r})"
        )
    precision = meta.get("precision")
    if precision is not None and not isinstance(precision, (int, float)):
        return Skip("bad_record", f"{ex.id}: precision {precision!r} is not a number of decimals")
    meta["precision"] = None if precision is None else int(precision)  # parquet stores it as a float
    question = ex.question + (f" (Unit: {meta['unit']})" if meta.get("unit") else "")
    hint = "" if multi else _hint(kind, meta["precision"])
    return replace(
        ex,
        question=with_choices(question, ex.choices if multi else None) + hint,
        choices=ex.choices if multi else None,
        metadata=meta,
    )


def _hint(kind: str, precision: int | None) -> str:
    """What kind of answer a free-form problem wants (our wording of MathVista's query hints)."""
    if kind == "integer":
        return "\nAnswer with an integer."
    if kind == "float" and precision is not None:
        return f"\nAnswer with a number with {precision} decimal place{'s' * (precision != 1)}."
    if kind == "list":
        return "\nAnswer with a Python list, e.g. [1, 2, 3]."
    return ""


def grade_mathvista(example: Example, response: str) -> bool:
    """MathVista's rules (module doc): the option for multiple choice, integers truncated, floats rounded to the
    problem's precision, lists element-wise, the unit stripped."""
    if example.choices:
        return grade_response(example, response)
    pred, gold = extract_answer(response, "auto"), example.answer
    if pred is None or gold is None:
        return False
    pred, kind = _without_unit(pred, example.metadata.get("unit")), example.metadata.get("answer_type")
    if kind == "list":
        return _same_list(gold, pred)
    if kind in ("integer", "float"):
        return _same_number(gold, pred, kind, example.metadata.get("precision"))
    return answers_equivalent(gold, pred)


def _without_unit(pred: str, unit: str | None) -> str:
    if not unit:
        return pred
    u = re.escape(unit)
    return re.sub(rf"\s*(?:\\text\s*\{{\s*{u}\s*\}}|{u})\s*$", "", pred.strip()) or pred


def _number(s: str) -> float | None:
    try:
        value = float(normalize_answer(s))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _same_number(gold: str, pred: str, kind: str, precision: int | None) -> bool:
    g, p = _number(gold), _number(pred)
    if g is None or p is None or (kind == "float" and precision is None):
        return answers_equivalent(gold, pred)
    if kind == "integer":
        return int(p) == int(g)
    return round(p, precision) == round(g, precision)


def _same_list(gold: str, pred: str) -> bool:
    def items(s: str) -> list[str]:
        s = s.strip()
        if s[:1] in "[(" and s[-1:] in "])":
            s = s[1:-1]
        return [x.strip() for x in s.split(",")]

    golds, preds = items(gold), items(pred)
    return len(golds) == len(preds) and all(
        _number(g) == _number(p) if _number(g) is not None else answers_equivalent(g, p) for g, p in zip(golds, preds)
    )


def by_skill(records: list[dict], examples: list[Example]) -> dict:
    """Accuracy per skill (MathVista's reasoning skills; a problem has one to three)."""
    return {"by_skill": accuracy_by(records, examples, "skills")}


MATHVISTA = Benchmark(
    "mathvista",
    "mathvista",
    "testmini",
    category="task",
    max_new_tokens=1024,
    grade=grade_mathvista,
    aggregate=by_skill,
)

"""easy-vqa questions for the experiment, with the metadata its unlabelled pool needs. Loaders
(`vlm_corl.data.loaders`'s `module:function` form): `...easyvqa_data:load` (any range, with options) and
`...easyvqa_data:labelled` (the questions before UNLABELLED_START, where warm-start slices lie).

Question index ranges of easy-vqa train (38,575 questions, ordered by image, so the ranges share no image):
[0, 20000) labelled warm-start slices, [20000, 35000) the unlabelled pool label-free training draws from,
[35000, end) validation (the probe and every tuning decision; never test).

Each example gets `asked`: the question type read from the wording alone ("what color ..." -> color; "what
shape ...", "what is the <colour> shape?" -> shape; else yes/no), label-free, so an unlabelled pool can be
balanced or chosen by it without reading an answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from vlm_corl.data.loaders import balance_by, declares_category, load_easyvqa
from vlm_corl.data.records import Example

UNLABELLED_START, VALIDATION_START = 20000, 35000
TYPES = ("color", "shape", "yes/no")


def asked_type(question: str) -> str:
    """The easy-vqa question type from the wording only (it agrees with the answer-based type on every train
    question)."""
    if question.startswith(("what color", "what is the color")):
        return "color"
    if question.startswith(("what shape", "which shape")) or (
        question.startswith("what is the") and question.endswith(" shape?")
    ):
        return "shape"
    return "yes/no"


@declares_category("question_type")
def load(
    path,
    split: str = "train",
    start: int = 0,
    stop: int | None = None,
    asked: list[str] | None = None,
    balanced: bool = False,
) -> Iterator[Example]:
    """easy-vqa `split` questions [start, stop) with the metadata above; `asked`: only these question types as
    asked (by wording); `balanced`: an equal number of each type as asked, in source order."""
    examples = []
    for index, ex in enumerate(load_easyvqa(path, split)):
        if index < start or (stop is not None and index >= stop) or (asked and asked_type(ex.question) not in asked):
            continue
        examples.append(dataclasses.replace(ex, metadata={**ex.metadata, "asked": asked_type(ex.question)}))
    return iter(balance_by(examples, "asked") if balanced else examples)


@declares_category("question_type")
def labelled(path, split: str = "train") -> Iterator[Example]:
    """The questions a warm-start slice may draw from: train before UNLABELLED_START."""
    return load(path, split, stop=UNLABELLED_START)


def validation(limit: int) -> list[Example]:
    """`limit` validation questions (train from VALIDATION_START), balanced over question types."""
    return balance_by(list(load(None, "train", start=VALIDATION_START)), "question_type", limit)

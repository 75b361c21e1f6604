"""easy-vqa questions for the experiment, with the metadata its skill-weighted warm starts and its unlabelled
pool need. Loaders (`vlm_corl.data.loaders`'s `module:function` form): `...easyvqa_data:load` (any range, with
options) and `...easyvqa_data:labelled` (the questions before UNLABELLED_START, where warm-start slices lie).

Question index ranges of easy-vqa train (38,575 questions, ordered by image, so the ranges share no image):
[0, 20000) labelled warm-start slices, [20000, 35000) the unlabelled pool label-free training draws from,
[35000, end) validation (the probe and every tuning decision; never test).

Tiny members learn to name an image's colour but not its shape (README, the experiment's section), so a
member's *skill* here is a palette: member A is warm-started mostly on images whose colour is in
PALETTES["A"], member B mostly on PALETTES["B"]. Each example gets:

  asked    the question type read from the wording alone ("what color ..." -> color; "what shape ...",
           "what is the <colour> shape?" -> shape; else yes/no): label-free, so the unlabelled pool can be
           chosen by it without reading an answer;
  palette  "A" or "B": the palette of the image's colour, from a colour question on the same image (None when
           the image has none); used only to draw the labelled slices and to break validation numbers down;
  skill    "<question type>/<palette>", the key a warm-start mix weights.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

from vlm_corl.data.loaders import balance_by, load_easyvqa
from vlm_corl.data.records import Example

UNLABELLED_START, VALIDATION_START = 20000, 35000
PALETTES = {"A": ("black", "blue", "brown", "gray"), "B": ("green", "red", "teal", "yellow")}
PALETTE_OF = {colour: name for name, colours in PALETTES.items() for colour in colours}
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


@functools.lru_cache(maxsize=None)
def image_palettes(split: str) -> dict[int, str]:
    """{image id: palette} of every image of `split` whose colour some colour question gives."""
    return {
        ex.metadata["image_id"]: PALETTE_OF[ex.answer]
        for ex in load_easyvqa(None, split)
        if ex.metadata["question_type"] == "color"
    }


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
    palettes = image_palettes(split)
    examples = []
    for index, ex in enumerate(load_easyvqa(path, split)):
        if index < start or (stop is not None and index >= stop) or (asked and asked_type(ex.question) not in asked):
            continue
        palette = palettes.get(ex.metadata["image_id"])
        examples.append(
            dataclasses.replace(
                ex,
                metadata={
                    **ex.metadata,
                    "asked": asked_type(ex.question),
                    "palette": palette,
                    "skill": f"{ex.metadata['question_type']}/{palette}",
                },
            )
        )
    return iter(balance_by(examples, "asked") if balanced else examples)


def labelled(path, split: str = "train") -> Iterator[Example]:
    """The questions a warm-start slice may draw from: train before UNLABELLED_START."""
    return load(path, split, stop=UNLABELLED_START)


def validation(limit: int) -> list[Example]:
    """`limit` validation questions (train from VALIDATION_START), balanced over question types."""
    return balance_by(list(load(None, "train", start=VALIDATION_START)), "question_type", limit)


def skill_mix(palette: str, own: float, types: tuple[str, ...] = TYPES) -> tuple[tuple[str, float], ...]:
    """A warm-start mix (BaseRecipe.mix over `skill`): question types in equal shares, a share `own` of each
    type's questions on images of `palette`'s colours and the rest on the other palette's."""
    other = next(p for p in PALETTES if p != palette)
    return tuple((f"{t}/{p}", share) for t in types for p, share in ((palette, own), (other, 1 - own)))

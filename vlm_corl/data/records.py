"""The example record: one question (with 0..n images) as every phase of the cohort loop sees it.

Loaders (`vlm_corl.data.loaders`, `text_corl.data`) produce `Example`s; the sampler hands the same example ids to
every member, and each member renders the question in its own *view* (`Example.question_for`).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from vlm_corl.data.mapped import TableImage
from vlm_corl.errors import UserError

ImageSource = Union[str, bytes, TableImage]
"""An image as a record holds it: an absolute file path, the encoded file's bytes (PNG, JPEG, ...), or where such
bytes sit in a memory-mapped Arrow table (`TableImage`: the "hf" loader's embedded pictures, read when used).
Records never hold decoded pixels; `vlm_corl.data.images.load_image` decodes a source when it is rendered."""

ORIGINAL_VIEW = "original"


class ViewError(UserError, ValueError):
    """A view name that is malformed, or that asks for a paraphrase the example does not have."""


def parse_view(view: str) -> int:
    """The paraphrase number a view names: 0 for "original", K for "paraphrase:K" (K >= 1).

    Raises ViewError for anything else, so a config can check its views before any example is loaded.
    """
    if view == ORIGINAL_VIEW:
        return 0
    kind, _, number = view.partition(":")
    if kind == "paraphrase" and number.isdigit() and int(number) >= 1:
        return int(number)
    raise ViewError(f"unknown view {view!r}: use 'original' or 'paraphrase:K' with K = 1, 2, ...")


@dataclass(frozen=True)
class Example:
    """One question, optionally with images, a gold answer and a choice list.

    The gold `answer` is for diagnostics, evaluation and the `gt` baseline only: peer rewards never read it.
    """

    id: str
    """Unique within a dataset and stable across runs (members are sampled in lockstep by id)."""
    question: str
    """The question in its original wording."""
    images: tuple[ImageSource, ...] = ()
    """The images the question refers to, in order (file paths, encoded bytes or `TableImage`s); empty for text-only
    data."""
    answer: str | None = None
    """The gold final answer as a string, when the dataset has one."""
    choices: tuple[str, ...] | None = None
    """The options of a multiple-choice question, in order (option i is letter A + i); None otherwise."""
    paraphrases: tuple[str, ...] = ()
    """Alternative wordings of the question with the same answer; view "paraphrase:K" reads paraphrases[K-1]."""
    source: str = ""
    """The dataset the example comes from (e.g. "easyvqa", "math500")."""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    """Everything else the dataset carries (question type, subject, level, ...); never read by the method."""

    def question_for(self, view: str) -> str:
        """The question as member with this view sees it: "original" or "paraphrase:K" (1-based).

        Raises ViewError when the view is malformed or the example has fewer than K paraphrases.
        """
        k = parse_view(view)
        if k == 0:
            return self.question
        if k > len(self.paraphrases):
            raise ViewError(
                f"example {self.id!r} ({self.source or 'unknown source'}) has {len(self.paraphrases)} "
                f"paraphrase(s), so view {view!r} has no question: give the dataset a 'paraphrases' field "
                f"with at least {k} wording(s) per example, or use view 'original'"
            )
        return self.paraphrases[k - 1]

    def wording_for(self, view: str) -> str:
        """The question as a slot with this view was asked: its view's wording, or the original where the
        example lacks it (a run goes on past that only under data.view_fallback: original)."""
        try:
            return self.question_for(view)
        except ViewError:
            return self.question


def with_choices(question: str, choices: Sequence[str] | None) -> str:
    """The question followed by its options, "(A) …" one a line (MathVista's own query layout): how a loader
    shows a multiple-choice question, since prompts render `Example.question` alone."""
    if not choices:
        return question
    return (
        question + "\nChoices:\n" + "\n".join(f"({letter}) {c}" for letter, c in zip(string.ascii_uppercase, choices))
    )

"""Text benchmark loaders, found by `vlm_corl.registry.LOADERS` through the `vlm_corl.loaders` entry points.

Each follows the loader contract of `vlm_corl.data` and is used through `vlm_corl.data.load_examples`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from vlm_corl.data import DataError, Skip, example_from_row, resolve_data_file
from vlm_corl.records import Example


MATH500_DIR = Path(__file__).resolve().parent / "datasets" / "math500"  # vendored copy (README.md there)


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
        raise DataError(f"cannot read {file} as JSON ({e}); MATH-500 is one JSON list of "
                        f'{{"prompt", "answer", "source", "id"}} objects') from e
    if not isinstance(rows, list):
        raise DataError(f"{file} holds a JSON {type(rows).__name__}, not the list of problems MATH-500 is")
    return (_math500_example(row, index, split, file.parent) for index, row in enumerate(rows))


def _math500_example(row: object, index: int, split: str, directory: Path) -> Example | Skip:
    item = example_from_row(row, fallback_id=f"math500-{split}-{index:06d}", source="math500", image_root=directory)
    if isinstance(item, Skip):
        return item
    parts = item.id.split("/")  # "test/<subject>/<number>.json"
    return replace(item, metadata={**item.metadata, "subject": parts[1]}) if len(parts) == 3 else item

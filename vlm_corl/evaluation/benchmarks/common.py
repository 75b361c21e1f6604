"""What the multimodal benchmark modules share: reading an official release (its JSON/JSONL file, its parquet
or Hugging Face dataset directory, or the hub by name), the option list in the prompt, the grader and accuracy
per metadata value."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from vlm_corl.data.answers import grade
from vlm_corl.data.loaders import DataError, Skip, _hf_rows, example_from_row, hub_dataset, load_hf, missing_path
from vlm_corl.data.records import Example
from vlm_corl.evaluation.scoring import _by_type

JSON_SUFFIXES = (".json", ".jsonl")


@dataclass(frozen=True)
class Release:
    """Where a benchmark's official release lives and how its records name the Example fields: fixed per
    benchmark, so each module states it once and `release_examples` reads it for any path and split."""

    loader: str  # the benchmark's name: the examples' source, in ids and messages
    hub: str  # the Hugging Face dataset read when no path is given
    fields: Mapping[str, str]  # Example field -> record key, in the JSON (GitHub) release
    dataset_fields: Mapping[str, str] | None = None  # the same in the parquet release (default: `fields`)
    hub_config: str | None = None  # the hub dataset's config, when it has several


def release_examples(
    release: Release,
    path: str | os.PathLike | None,
    split: str,
    *,
    image_root: str | os.PathLike | None = None,
) -> Iterator[Example | Skip]:
    """A benchmark's records as Examples (or Skips for records that cannot be read), from:

    - `path`, a .json/.jsonl file or a directory holding `<split>.json`/`<split>.jsonl` (a GitHub release: a
      JSON list of records, an object of records keyed by id, or JSON Lines), image paths relative to
      `image_root` (default: the file's folder);
    - `path`, any other file or directory `vlm_corl.data.load_hf` reads (the Hugging Face parquet release);
    - no `path`: the dataset `release.hub` (`release.hub_config`) through `datasets.load_dataset`, when the hub
      can be reached.

    `release.fields` names the Example fields in the JSON release, `release.dataset_fields` in the parquet one
    (default: `release.fields`).
    """
    loader, fields = release.loader, release.fields
    dataset_fields = release.dataset_fields or fields  # the parquet release's (and the hub's) field names
    if path is None:
        dataset = hub_dataset(release.hub, release.hub_config, split, loader)
        return _hf_rows(dataset, split, loader, Path(image_root or Path.cwd()).resolve(), dataset_fields)
    path = Path(path)
    if not path.exists():
        raise missing_path(path)
    file = _json_file(path, split)
    if file is None and path.is_dir() and not any(p.suffix in (".parquet", ".arrow") for p in path.rglob("*")):
        raise DataError(
            f"{path} holds neither {split}.json / {split}.jsonl (the GitHub release) nor parquet files "
            f"(the Hugging Face release) of the {loader} benchmark: give the data file itself or its "
            f"folder"
        )
    if file is None:
        return load_hf(path, split, fields=dataset_fields, image_root=image_root, source=loader)
    root = Path(image_root) if image_root is not None else file.parent
    return (
        row
        if isinstance(row, Skip)
        else example_from_row(
            row, fallback_id=f"{loader}-{split}-{index:06d}", source=loader, image_root=root.resolve(), fields=fields
        )
        for index, row in enumerate(_json_rows(file))
    )


def _json_file(path: Path, split: str) -> Path | None:
    if path.is_file():
        return path if path.suffix in JSON_SUFFIXES else None
    return next((path / f"{split}{s}" for s in JSON_SUFFIXES if (path / f"{split}{s}").is_file()), None)


def _json_rows(file: Path) -> Iterator[object]:
    """The records of a JSON list, of a JSON object keyed by record id (MathVista's), or of JSON Lines (a line
    that does not parse is a Skip)."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {file}: {e}") from e
    if file.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError as e:
                    yield Skip("undecodable_line", f"{file}:{number}: {e}")
        return
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DataError(f"{file} is not valid JSON ({e}); the release is a JSON list of records") from e
    if isinstance(data, dict):
        data = list(data.values())
    if not isinstance(data, list):
        raise DataError(f"{file} holds a JSON {type(data).__name__}, not a list of records")
    yield from data


def lift_metadata(metadata: Mapping) -> dict:
    """`metadata` with its nested "metadata" record (MathVista's and MathVerse's) merged into the top level."""
    nested = metadata.get("metadata")
    top = {k: v for k, v in metadata.items() if k != "metadata"}
    return {**top, **nested} if isinstance(nested, Mapping) else top


def grade_response(example: Example, response: str) -> bool:
    """Whether the response's answer is the gold one. Extraction is "auto", so both prompt styles a member may
    use are read (<answer> tags, else the last \\boxed{}, else "the answer is …"), and for multiple choice a
    short reply ("B", "(B)", the option's text) too; a letter and its option's text are the same answer."""
    return example.answer is not None and grade(response, example.answer, "auto", example.choices)


def accuracy_by(records: list[dict], examples: list[Example], key: str) -> dict[str, float]:
    """Accuracy per value of metadata[key]; a list value counts the record under each of its items."""
    metadata = {ex.id: ex.metadata for ex in examples}
    regrouped = []
    for record in records:
        value = metadata[record["id"]].get(key)
        regrouped += [
            {**record, "type": str(v)} for v in (value if isinstance(value, list) else [value]) if v is not None
        ]
    return _by_type(regrouped)

"""Dataset loaders and the one function that turns any of them into validated `Example`s.

A *loader* is a function registered in `vlm_corl.registry.LOADERS`:

    loader(path: str | os.PathLike | None, split: str, **options) -> Iterable[Example | Skip]

It raises `DataError` when its source cannot be read at all (no path, missing file, wrong format), and
otherwise yields one item per record: the `Example`, or a `Skip` for a record it cannot even parse (an
undecodable line, a field of the wrong type). It does no other checking: `load_examples` applies the same
checks to every loader's records (empty question, duplicate id, images that do not decode) and counts every
record it drops, by reason, in a `LoadReport`.

Images are never dropped silently. A record whose image field is null (or "", or an Image value with neither
bytes nor path) has lost its image: it is dropped and counted ("no_image"). A record without the field (or with
an empty list) is a text-only question, kept beside image ones (a dataset may mix them). No record with an image
at all is a DataError naming the columns when the image field is null in every record, or when pictures sit in
a column no field reads (a misnamed image column). A source with no known end (a stream: the
loader returns a `Stream`) is read lazily, only up to `limit`, and refused without one.

Built-in loaders: "jsonl" (JSONL + image folder), "hf" (a Hugging Face dataset on local disk), "easyvqa" (the
easy-vqa PyPI package); `text_corl` adds "math500" through an entry point. A user loader is any function with
the signature above, named as "package.module:function" or registered under a name.

Record fields understood by "jsonl" and "hf" (the first name present wins; `fields={"question": "query"}`
names another column for a field, which then must exist):

    id           "id" (string or integer); default "<source>-<split>-<row index, 6 digits>"
    question     "question", "prompt", "problem"
    images       "images", "image": a path (relative to `image_root`), a {"bytes", "path"} mapping (the
                 datasets Image feature), raw bytes, or a list of these; absent or [] for a text-only record
                 (null: the record lost its image, and is dropped as "no_image")
    answer       "answer" (string or number)
    choices      "choices", "options" (list of strings or numbers)
    paraphrases  "paraphrases" (list of strings)
    metadata     every other field, under its own name
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlm_corl.data.image_checks import ImageChecks, identity, image_checks
from vlm_corl.data.images import BadImage, load_image
from vlm_corl.data.mapped import TableImage, locator, mapped_rows, picture_type, references
from vlm_corl.data.records import Example, ImageSource
from vlm_corl.errors import UserError
from vlm_corl.registry import LOADERS

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

FIELD_NAMES: dict[str, tuple[str, ...]] = {
    "id": ("id",),
    "question": ("question", "prompt", "problem"),
    "images": ("images", "image"),
    "answer": ("answer",),
    "choices": ("choices", "options"),
    "paraphrases": ("paraphrases",),
}
"""Example field -> record field names tried in order (see the module docstring)."""

SAMPLES_PER_REASON = 5
"""How many dropped records a `LoadReport` names per reason (all of them are counted)."""


class DataError(UserError):
    """A dataset that cannot be read at all; the message names the path and what to do."""


@dataclass(frozen=True)
class Skip:
    """A record a loader could not turn into an `Example`: `reason` is a short key, `detail` says where/why;
    `columns`, where the loader gives them, are the record's own field names (for a message naming them)."""

    reason: str
    detail: str
    columns: tuple[str, ...] = field(default=(), compare=False)


IMAGE_REASONS = frozenset(
    {"image_url", "missing_image", "unreadable_image", "zero_size_image", "corrupt_image", "oversized_image"}
)
"""Skip reasons of a record that names an image which does not load: the data has images."""

STREAM_READS_PER_EXAMPLE = 10
"""A stream is read for at most this many records per example asked for (and at least `STREAM_MIN_READS`): a
stream whose records are all dropped ends the load, not the run's memory."""
STREAM_MIN_READS = 1000


class Stream(Iterator):
    """A loader's records from a source with no known end (a `datasets.IterableDataset`, a torch
    `IterableDataset`, a generator): `load_examples` reads it lazily, up to its `limit`, and refuses it without one.
    `what` names the source and `limit_setting` where its user gives the limit (e.g. "data.train.limit")."""

    def __init__(self, records: Iterable, what: str, limit_setting: str):
        self._records = iter(records)
        self.what = what
        self.limit_setting = limit_setting
        self.read = 0  # records pulled so far

    def __iter__(self) -> Stream:
        return self

    def __next__(self):
        item = next(self._records)
        self.read += 1
        return item


@dataclass
class LoadReport:
    """What `load_examples` kept and what it dropped, by reason (in the order reasons were first met)."""

    loader: str
    path: str | None
    split: str
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)
    """reason -> the first `SAMPLES_PER_REASON` dropped records, as "id: detail" or the loader's detail."""
    skip_first: int = 0  # kept examples a training run passes over first (data.train.skip)
    used: int | None = None  # the examples the run uses (after data.train.skip and limit); None: all kept
    no_image_columns: set[str] = field(default_factory=set, repr=False)  # the columns of records without an image

    def skip(self, reason: str, detail: str) -> None:
        """Count one dropped record."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        samples = self.samples.setdefault(reason, [])
        if len(samples) < SAMPLES_PER_REASON:
            samples.append(detail)

    @property
    def total_skipped(self) -> int:
        """Dropped records, all reasons together."""
        return sum(self.skipped.values())

    def summary(self) -> str:
        """One line of totals, then one line per skip reason with its first few records."""
        where = f" {self.path}" if self.path is not None else ""
        lines = [f"{self.loader}[{self.split}]{where}: kept {self.kept}, skipped {self.total_skipped}"]
        if self.used is not None and (self.used != self.kept or self.skip_first):
            lines[0] += f"; the run uses {self.used} (after the first {self.skip_first} and the limit)"
        for reason, count in self.skipped.items():
            lines.append(f"  {reason}: {count} (e.g. {'; '.join(self.samples[reason])})")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form for run logs."""
        return {
            "loader": self.loader,
            "path": self.path,
            "split": self.split,
            "kept": self.kept,
            "used": self.kept if self.used is None else self.used,
            "skipped": dict(self.skipped),
            "samples": {reason: list(s) for reason, s in self.samples.items()},
        }


@dataclass(frozen=True)
class LoadResult:
    """The examples that passed every check, in source order, and the report of what was dropped."""

    examples: list[Example]
    report: LoadReport


def load_examples(
    loader: str,
    path: str | os.PathLike | None = None,
    split: str = "train",
    limit: int | None = None,
    **options: Any,
) -> LoadResult:
    """Read a dataset with the named loader and keep the records that pass every check.

    `limit` stops after that many kept examples. `options` go to the loader. A record is dropped, and counted
    under its reason, when the loader yields a `Skip`, its question is blank ("empty_question"), its id was
    already kept ("duplicate_id"; the first wins), one of its images fails `load_image` (a `BadImage`
    reason: "missing_image", "corrupt_image", "zero_size_image", ...), or it has no image in data that has
    images or a null image field ("no_image": see the module doc). Each distinct image is decoded once.
    Raises `DataError` when the source cannot be read, no record survives (a tailored message when records
    were dropped for a null image), or no record has an image but a column holds pictures; `ConfigError`
    (naming the loader's limit setting) for a `Stream` without `limit`.
    """
    if limit is not None and limit < 1:
        raise DataError(f"limit must be at least 1, or None for every record (got {limit})")
    items = _read(loader, path, split, options)
    _refuse_endless_stream(items, limit)
    report = LoadReport(loader, None if path is None else os.fspath(path), split)
    examples = _checked(items, report, limit)
    report.kept = len(examples)
    where = report.path or str(options.get("source") or loader)  # the Python API's: train_dataset, eval_dataset
    _refuse_unusable(examples, report, where)
    if report.skipped.get("no_image"):
        log.warning(
            "%d record(s) of %s have lost their image (a null image field): dropped, as a question about a picture "
            "cannot be asked without it; e.g. %s",
            report.skipped["no_image"],
            where,
            "; ".join(report.samples["no_image"][:2]),
        )
    if report.skipped:
        log.warning("dropped records while loading data:\n%s", report.summary())
    return LoadResult(examples, report)


def _read(loader: str, path: str | os.PathLike | None, split: str, options: dict[str, Any]) -> Iterable[Example | Skip]:
    """The records of the named loader, its options checked first against its signature: an option it does not take
    is the user's mistake (data.train.options), told with the options it accepts, not a TypeError from inside."""
    fn = LOADERS.get(loader)
    try:
        inspect.signature(fn).bind(path, split, **options)
    except TypeError as err:
        accepted = [p for p in list(inspect.signature(fn).parameters)[2:]]
        raise DataError(
            f"the {loader!r} loader does not take these options {sorted(options)} ({err}); it accepts "
            f"{accepted or 'no options'} (data.train.options)"
        ) from err
    return fn(path, split, **options)


def _refuse_endless_stream(items: Iterable[Example | Skip], limit: int | None) -> None:
    """Refuse a `Stream` without `limit` (`ConfigError` naming the loader's limit setting): it would be read
    forever."""
    if isinstance(items, Stream) and limit is None:
        from vlm_corl.config.parse import ConfigError  # the data layer does not import the config package

        setting = items.limit_setting
        raise ConfigError(
            [
                f"{setting}: {items.what} is a stream with no known end, read only up to {setting}, which is "
                f"not set (it would be read forever): set {setting} to the number of examples to use"
            ],
            [setting],
        )


def _refuse_unusable(examples: list[Example], report: LoadReport, where: str) -> None:
    """`DataError` when no record survived (a tailored message when records were dropped for a null image), or
    when no record has an image but a column holds pictures (`_refuse_misnamed_images`)."""
    if not examples and report.skipped.get("no_image"):
        raise DataError(_no_image_at_all(report, where, report.loader))
    if not examples:
        raise DataError(
            f"no usable example in {report.path or report.loader} (split {report.split!r}):\n{report.summary()}\n"
            f"Check the path, the split and the field names (see vlm_corl.data.loaders)."
        )
    if not any(ex.images for ex in examples) and not report.skipped.keys() & IMAGE_REASONS:
        _refuse_misnamed_images(examples, where, report.loader)


def _checked(items: Iterable[Example | Skip], report: LoadReport, limit: int | None) -> list[Example]:
    """The examples of `items` that pass every check, in order, at most `limit`; every dropped one counted in
    `report`. A `Stream` is read for at most STREAM_READS_PER_EXAMPLE x `limit` records."""
    examples: list[Example] = []
    kept_ids: set[str] = set()
    image_problems: dict[ImageSource, BadImage | None] = {}
    stream = items if isinstance(items, Stream) else None
    most = None if stream is None or limit is None else max(STREAM_MIN_READS, STREAM_READS_PER_EXAMPLE * limit)
    # a stream is checked record by record: its records read (stream.read) bound the load
    chunk = 1 if stream is not None else min(CHECK_CHUNK, limit or CHECK_CHUNK)
    checks = image_checks(f"{report.loader}\0{report.path and os.path.realpath(report.path)}\0{report.split}")
    try:
        for item in _prefetched(items, image_problems, chunk, checks):
            if isinstance(item, Skip):
                report.skip(item.reason, item.detail)
                if item.reason == "no_image":
                    report.no_image_columns.update(item.columns)
            else:
                problem = _problem(item, kept_ids, image_problems)
                if problem is not None:
                    report.skip(problem[0], f"{item.id}: {problem[1]}")
                else:
                    examples.append(item)
                    kept_ids.add(item.id)
                    if len(examples) == limit:
                        break
            if most is not None and stream.read >= most:
                log.warning(
                    "%s: stopped reading after %d records, %d of them kept (of %d asked for): the stream's records are "
                    "mostly dropped (%s)",
                    stream.what,
                    stream.read,
                    len(examples),
                    limit,
                    ", ".join(f"{reason}: {n}" for reason, n in report.skipped.items()),
                )
                break
    finally:
        checks.save()  # what was checked stays checked, whatever ends the load
    return examples


CHECK_CHUNK = 1024
"""Records read ahead so that their pictures are checked together (in parallel, `image_checks`); a `limit` below
it reads only that many ahead."""


def _prefetched(
    items: Iterable[Example | Skip], image_problems: dict, chunk: int, checks: ImageChecks
) -> Iterator[Example | Skip]:
    """`items` in order, each `chunk` of them read first and their pictures not yet in `image_problems` checked
    together through the dataset's cache (`ImageChecks.check`), their outcomes put there."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, chunk)):
        sources = [s for item in batch if isinstance(item, Example) for s in item.images if s not in image_problems]
        image_problems.update(checks.check(sources, load_image))
        yield from batch


def _no_image_at_all(report: LoadReport, where: str, loader: str) -> str:
    """The refusal of data whose records name an image field but none holds an image."""
    columns = sorted(report.no_image_columns)
    return (
        f"{where}: no record has an image, though the records name one: {report.skipped['no_image']} "
        f"record(s) without their image (e.g. {'; '.join(report.samples['no_image'][:3])}); their columns: "
        f"{', '.join(columns) or 'unknown'}. The images were lost when the data was made, or are in another "
        f"column: {_name_it(loader, '<column>')} (if the data is text-only, remove the null image column)\n"
        f"{report.summary()}"
    )


def _refuse_misnamed_images(examples: list[Example], where: str, loader: str) -> None:
    """DataError when no example has an image but a column that is read as no field holds pictures (bytes of an
    image file, a {"bytes", "path"} image value, a path or URL of an image file): a misnamed image column."""
    for ex in examples[:IMAGE_SCAN]:
        for column, value in ex.metadata.items():
            if _looks_like_image(value):
                other = sorted({k for e in examples[:IMAGE_SCAN] for k in e.metadata})
                raise DataError(
                    f"{where}: no record has an image under "
                    f"{' or '.join(repr(n) for n in FIELD_NAMES['images'])}, but column {column!r} holds "
                    f"pictures (e.g. record {ex.id}: {_shown(value)}); columns not read as an example "
                    f"field: {', '.join(other)}. If they are the questions' images, {_name_it(loader, column)}; if "
                    f"the data is text-only, remove that column"
                )


IMAGE_SCAN = 200
"""Examples whose other columns are looked at for pictures when no example has an image."""

_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")


def _looks_like_image(value: Any) -> bool:
    """A picture as a record would hold it: image file bytes, a decoded image, a datasets Image value, or the
    path or URL of an image file (or a non-empty list of these)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_looks_like_image(v) for v in value)
    if isinstance(value, Mapping) and set(value) <= {"bytes", "path"} and value:
        return _looks_like_image(value.get("bytes")) or _looks_like_image(value.get("path"))
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).startswith(_IMAGE_MAGIC)
    if isinstance(value, str):
        return len(value) < 1000 and "\n" not in value and value.split("?")[0].lower().endswith(_IMAGE_SUFFIXES)
    return all(hasattr(value, a) for a in ("save", "mode", "size"))  # a PIL image


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}, first {_shown(value[0])}"
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, Mapping):
        return "{'bytes': ..., 'path': ...}"
    return repr(value) if isinstance(value, str) else type(value).__name__


def _name_it(loader: str, column: str) -> str:
    """How a user names a dataset's image column, for this loader."""
    if loader == "python":
        return f"name it with columns={{'image': {column!r}}}"
    return f"name it with the loader option fields={{'images': {column!r}}} (data.train.options.fields)"


HUB_TIMEOUT_S = 5.0
"""How long the dataset hub may take to accept a connection: `datasets` retries an unreachable hub for ~25 s."""


def hub_dataset(name: str, config: str | None, split: str, loader: str) -> datasets.Dataset:
    """`datasets.load_dataset(name, config, split=split)` for a loader given no path, on a machine that reaches
    the Hugging Face hub (or with HF_HUB_OFFLINE=1, from what `datasets` cached before); elsewhere a DataError
    naming `--data LOADER=PATH`. No dataset script is run (no trust_remote_code)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    try:
        if not constants.HF_HUB_OFFLINE:
            url = urlparse(constants.ENDPOINT)
            port = url.port or (443 if url.scheme == "https" else 80)
            socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT_S).close()
        import datasets

        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # no network, no such split, an interrupted download: the user's fix is the same
        raise DataError(
            f"the {loader!r} loader got no path and cannot load {name} from the Hugging Face hub "
            f"({constants.ENDPOINT}: {type(e).__name__}: {str(e)[:200]}); download the official release "
            f"and give it with --data {loader}=PATH (data.train.path in a config)"
        ) from e


def missing_path(path: Path) -> DataError:
    """The error for a data path that does not exist."""
    return DataError(
        f"{path} does not exist: check the data path (data.train.path in a cohort config; relative "
        f"paths are from {Path.cwd()})"
    )


def balance_by(examples: list[Example], key: str, limit: int | None = None) -> list[Example]:
    """An equal number of examples of every value of metadata[key] (at most `limit` in all), in source order.

    easy-vqa is 74% yes/no questions: a balanced slice keeps a few answerable-from-text questions from
    dominating a warm start or an accuracy figure.
    """
    if examples and not any(key in ex.metadata for ex in examples):
        found = sorted({k for ex in examples for k in ex.metadata})
        raise DataError(f"cannot balance by {key!r}: no example has that metadata key (keys: {found or 'none'})")
    groups: dict[str, list[Example]] = {}
    for ex in examples:
        groups.setdefault(str(ex.metadata.get(key)), []).append(ex)
    per_value = min(len(g) for g in groups.values())
    if limit is not None and limit < len(groups):
        raise DataError(
            f"a limit of {limit} cannot be balanced over the {len(groups)} values of {key!r} "
            f"({', '.join(sorted(groups))}); give at least {len(groups)}"
        )
    if limit is not None:
        per_value = min(per_value, limit // len(groups))
    return [ex for group in groups.values() for ex in group[:per_value]]


def _problem(
    example: Example, kept_ids: set[str], image_problems: dict[ImageSource, BadImage | None]
) -> tuple[str, str] | None:
    """(reason, detail) when the example must be dropped; `image_problems` holds each picture's check."""
    if not example.question.strip():
        return "empty_question", "blank question"
    if example.id in kept_ids:
        return "duplicate_id", "id already used by an earlier record"
    for src in example.images:  # every picture was checked as its records were read (`_prefetched`)
        if image_problems[src] is not None:
            return image_problems[src].reason, image_problems[src].detail
    return None


# ---------------------------------------------------------------------------------------------------------
# Shared by the loaders (and by text_corl's): locating a data file, mapping a record onto an Example.


def resolve_data_file(path: str | os.PathLike | None, split: str, suffixes: tuple[str, ...], loader: str) -> Path:
    """The data file for a split: `path` itself if it is a file, else `path/<split><suffix>`.

    Raises DataError naming the path when there is none.
    """
    if path is None:
        raise DataError(
            f"the {loader!r} loader needs a path to a {'/'.join(suffixes)} file or a directory holding "
            f"<split>{suffixes[0]}: data.train.path in a cohort file, --data NAME=PATH for the eval CLI"
        )
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for suffix in suffixes:
            if (path / f"{split}{suffix}").is_file():
                return path / f"{split}{suffix}"
        found = sorted(p.name for p in path.iterdir())[:20]
        raise DataError(
            f"{path} has no {split}{suffixes[0]} for split {split!r} (found: "
            f"{', '.join(found) or 'nothing'}); give the file itself as the path, or another split"
        )
    raise missing_path(path)


class _BadField(ValueError):
    """A record field of the wrong type (becomes a skip, "bad_record" unless `reason` says otherwise)."""

    def __init__(self, message: str, reason: str = "bad_record"):
        super().__init__(message)
        self.reason = reason


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def example_from_row(
    row: Any,
    *,
    fallback_id: str,
    source: str,
    image_root: Path,
    fields: Mapping[str, str] | None = None,
) -> Example | Skip:
    """Map one record (a JSON object or a dataset row) onto an Example using `FIELD_NAMES`.

    `fields` overrides the record field name for an Example field; `image_root` anchors relative image paths.
    Returns Skip("bad_record", ...) for a record that is not a mapping or has a field of the wrong type, and
    Skip("no_image", ...) for one whose image field is there but null ("", an Image value with neither bytes
    nor path, a list of only these), or absent where `fields` names it; [] is a record without images.
    """
    if not isinstance(row, Mapping):
        return Skip("bad_record", f"{fallback_id}: expected an object with fields, got {type(row).__name__}")
    names = _field_names(fields)
    used = {attr: next((n for n in names[attr] if n in row), None) for attr in names}

    def value(attr: str) -> Any:
        return None if used[attr] is None else row[used[attr]]

    if (used["images"] is not None or (fields and "images" in fields)) and _lost_image(value("images")):
        found = f"its {used['images']!r} field is {value('images')!r}" if used["images"] else None
        said = found or f"no {fields['images']!r} field"
        return Skip("no_image", f"{_own_id(value('id')) or fallback_id}: {said}", columns=tuple(map(str, row)))
    try:
        return Example(
            id=_text(value("id"), "id") or fallback_id,
            question=_text(value("question"), "question") or "",
            images=_images(value("images"), image_root),
            answer=_text(value("answer"), "answer"),
            choices=None if value("choices") is None else _texts(value("choices"), "choices"),
            paraphrases=() if value("paraphrases") is None else _texts(value("paraphrases"), "paraphrases"),
            source=source,
            metadata={k: v for k, v in row.items() if k not in used.values()},
        )
    except _BadField as e:
        return Skip(e.reason, f"{_own_id(value('id')) or fallback_id}: {e}")


def _own_id(value: Any) -> str | None:
    """The record's own id when it is readable (a record with a bad field is named by it, not by its line)."""
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) else None


def _field_names(fields: Mapping[str, str] | None) -> dict[str, tuple[str, ...]]:
    unknown = set(fields or ()) - set(FIELD_NAMES)
    if unknown:
        raise DataError(f"unknown field(s) {sorted(unknown)} in the 'fields' option; valid: {list(FIELD_NAMES)}")
    return {attr: (fields[attr],) if fields and attr in fields else names for attr, names in FIELD_NAMES.items()}


def _text(value: Any, name: str) -> str | None:
    # bool is an int subclass, but a true/false answer is a data error, not the number 1/0.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise _BadField(f"{name} must be a string or a number, got {type(value).__name__}")


def _texts(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise _BadField(f"{name} must be a list, got {type(value).__name__}")
    texts = tuple(_text(v, f"each of {name}") for v in value)
    if None in texts:
        raise _BadField(f"{name} has a null entry")
    return texts


def _lost_image(value: Any) -> bool:
    """An image field whose image is lost: null, "", an Image value with neither bytes nor path, or a non-empty
    list of only these ([] is a record without images: data_tools.prepare writes text records so)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_lost_image(v) for v in value)
    if isinstance(value, Mapping) and set(value) <= {"bytes", "path"}:
        return not value.get("bytes") and not value.get("path")
    return value is None or (isinstance(value, str) and not value)  # `== ""` on an array compares elementwise


def _images(value: Any, root: Path) -> tuple[ImageSource, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(_image(item, root) for item in items)


def _image(item: Any, root: Path) -> ImageSource:
    if isinstance(item, Mapping):  # the datasets Image feature stores {"bytes": ..., "path": ...}
        if item.get("bytes"):
            return item["bytes"]
        item = item.get("path")
    if isinstance(item, (bytes, TableImage)):
        return item
    if isinstance(item, str):
        if _URL.match(item):  # read as a path it would become ROOT/https:/host/...: name it as what it is
            raise _BadField(
                f"image {item!r} is a URL; images are read from local files (download it and give its path)",
                reason="image_url",
            )
        return str(root / item)  # an absolute path stays as it is
    if hasattr(item, "shape") and hasattr(item, "dtype"):  # an array a Python dataset gave that is no picture
        raise _BadField(
            f"an image array must be uint8 of shape HxW, HxWx3 or HxWx4 (PIL.Image.fromarray), got "
            f"{type(item).__name__} of shape {tuple(item.shape)} and dtype {item.dtype}"
        )
    raise _BadField(f"an image must be a path, bytes or a {{'bytes', 'path'}} mapping, got {type(item).__name__}")


# ---------------------------------------------------------------------------------------------------------
# "jsonl": one JSON object per line, images in a folder.


@LOADERS.register("jsonl")
def load_jsonl(
    path: str | os.PathLike | None,
    split: str = "train",
    *,
    image_root: str | os.PathLike | None = None,
    fields: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Iterator[Example | Skip]:
    """Records from a JSONL file (`path`, or `path/<split>.jsonl`), one object per line (fields: module doc).

    Relative image paths are resolved against `image_root` (default: the JSONL file's directory). `source`
    defaults to the name of that directory. Blank lines are not records; a line that is not valid JSON (or
    not UTF-8) yields Skip("undecodable_line").
    """
    file = resolve_data_file(path, split, (".jsonl",), "jsonl")
    name = source or file.resolve().parent.name
    root = Path(image_root) if image_root is not None else file.parent
    _field_names(fields)  # an unknown field name is a config error: raise it now, not once per record
    return _jsonl_rows(file, split, name, root.resolve(), fields)


def _jsonl_rows(file: Path, split: str, source: str, root: Path, fields) -> Iterator[Example | Skip]:
    try:
        handle = open(file, "rb")
    except OSError as e:
        raise DataError(f"cannot read {file}: {e.strerror or e}") from e
    with handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                row = json.loads(line)  # bytes in: invalid UTF-8 raises UnicodeDecodeError, a ValueError
            except ValueError as e:
                yield Skip("undecodable_line", f"line {index + 1}: {e}")
                continue
            yield example_from_row(
                row, fallback_id=f"{source}-{split}-{index:06d}", source=source, image_root=root, fields=fields
            )


# ---------------------------------------------------------------------------------------------------------
# "hf": a Hugging Face dataset on local disk.

_HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}


@LOADERS.register("hf")
def load_hf(
    path: str | os.PathLike | None,
    split: str = "train",
    *,
    fields: Mapping[str, str] | None = None,
    image_root: str | os.PathLike | None = None,
    source: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Iterator[Example | Skip]:
    """Records from a Hugging Face dataset on local disk; nothing is downloaded.

    `path` is a directory written by `save_to_disk` (a DatasetDict: `split` picks the split; a Dataset: used
    whole), a directory of data files whose names give the splits (`train.parquet`, `data/test-*.arrow`, ...),
    or one .parquet/.arrow/.json/.jsonl/.csv file (used whole). Embedded pictures (an `Image` feature's bytes, a
    binary column, or lists of these) stay in the memory-mapped Arrow files: a record holds a `TableImage` naming
    where each is, read when it is checked or rendered (`vlm_corl.data.mapped`); path-valued image columns are
    resolved against `image_root` (default: the dataset directory). `fields` maps Example fields to column names
    (see the module doc); `cache_dir` is where `datasets` converts data files to Arrow (default: its own cache).
    `source` defaults to the directory name.
    """
    if path is None:
        raise DataError(
            "the 'hf' loader needs a path: set data.train.path to a save_to_disk directory, a directory of "
            "parquet/arrow/json files, or one such file (nothing is downloaded)"
        )
    path = Path(path)
    if not path.exists():
        raise missing_path(path)
    _field_names(fields)  # an unknown field name is refused before the dataset is opened
    dataset = _open_hf(path, split, cache_dir)
    check_columns(dataset.column_names, fields, str(path), "fields")
    directory = path if path.is_dir() else path.parent
    name = source or directory.resolve().name
    root = Path(image_root) if image_root is not None else directory
    return _hf_rows(dataset, split, name, root.resolve(), fields)


def check_columns(columns: list[str], fields: Mapping[str, str] | None, where: str, option: str) -> None:
    """DataError when a column `fields` names is missing, or no question column is there (`where` names the
    dataset, `option` how the user names columns: "fields" for a loader, "columns" for the API)."""
    missing = [f"{column!r} (for {attr})" for attr, column in (fields or {}).items() if column not in columns]
    if missing:
        raise DataError(f"{where}: no column {', '.join(missing)}; its columns: {', '.join(columns)}")
    looked = _field_names(fields)["question"]
    if not set(looked) & set(columns):
        raise DataError(
            f"{where}: no question column (looked for {', '.join(looked)}; its columns: {', '.join(columns)}); "
            f"name it with {option}={{'question': '<column>'}}"
        )


def _open_hf(path: Path, split: str, cache_dir):
    # datasets takes ~1 s to import and only this loader needs it.
    import datasets

    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path), cache_dir=cache_dir)
        elif path.suffix in _HF_FILE_BUILDERS:
            loaded = datasets.load_dataset(
                _HF_FILE_BUILDERS[path.suffix], data_files=str(path), split="train", cache_dir=cache_dir
            )
        else:
            raise DataError(f"{path}: not a dataset file (expected {', '.join(_HF_FILE_BUILDERS)} or a directory)")
    except DataError:
        raise
    except Exception as e:  # datasets and pyarrow report unreadable data with many exception types
        raise DataError(
            f"cannot read {path} as a Hugging Face dataset ({type(e).__name__}: {e}); it should be a "
            f"save_to_disk directory or parquet/arrow/json/csv files"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path} has no split {split!r} (splits: {', '.join(loaded)})")
        return loaded[split]
    return loaded


def _hf_rows(dataset, split: str, source: str, root: Path, fields) -> Iterator[Example | Skip]:
    # The arrow format yields stored values without decoding features: Image columns stay {"bytes", "path"}.
    refer = _referrer(dataset, fields)
    index = 0
    for batch in dataset.with_format("arrow").iter(batch_size=1000):
        for row in batch.to_pylist() if refer is None else _rows_referring(batch, index, refer):
            yield example_from_row(
                row, fallback_id=f"{source}-{split}-{index:06d}", source=source, image_root=root, fields=fields
            )
            index += 1


def _referrer(dataset, fields) -> tuple[str, Callable[[int, int | None], TableImage]] | None:
    """(the images column, (dataset row, list index) -> the `TableImage` of its picture) when the column holds
    embedded pictures and the dataset's rows are its mapped Arrow files' (`mapped.mapped_rows`); else None (the
    records hold the bytes)."""
    column = next((n for n in _field_names(fields)["images"] if n in dataset.column_names), None)
    if column is None or not picture_type(dataset.data.schema.field(column).type):
        return None
    files = mapped_rows(dataset, column)
    stamps = {file: identity(file) for file, _ in files or ()}
    if files is None or None in stamps.values():
        return None
    locate = locator(files)

    def refer(row: int, index: int | None) -> TableImage:
        file, row_in_file = locate(row)
        return TableImage(file, row_in_file, column, index, stamps[file])

    return column, refer


def _rows_referring(batch, start: int, referrer: tuple[str, Callable]) -> list[dict]:
    """A batch's rows (dataset rows from `start` on) as `to_pylist` gives them, their pictures as `TableImage`s."""
    column, refer = referrer
    cells = references(batch.column(column), lambda row, index: refer(start + row, index))
    rest = batch.drop_columns([column]).to_pylist()
    return [
        {name: cells[i] if name == column else row[name] for name in batch.column_names} for i, row in enumerate(rest)
    ]


# ---------------------------------------------------------------------------------------------------------
# "easyvqa": the easy-vqa package (64x64 PNGs of one coloured shape; yes/no, shape and colour questions).

_EASYVQA_SHAPES = frozenset({"circle", "rectangle", "triangle"})

# The dataset's own wordings, grouped so that every wording in a group asks the same thing ({x} is a shape,
# a colour + "shape", or "shape"). "which shape is {x}?" is ours: "what is the {x} shape?" has no twin.
_EASYVQA_WORDINGS = (
    ("is there a {x}?", "is there a {x} in the image?", "does the image contain a {x}?", "is a {x} present?"),
    (
        "is there not a {x}?",
        "is there not a {x} in the image?",
        "does the image not contain a {x}?",
        "is no {x} present?",
    ),
    ("what color is the {x}?", "what is the color of the {x}?"),
    ("what shape is in the image?", "what shape does the image contain?", "what shape is present?"),
    ("what is the {x} shape?", "which shape is {x}?"),
)
_EASYVQA_PATTERNS = tuple(
    (re.compile(re.escape(wording).replace(re.escape("{x}"), r"(?P<x>[a-z]+(?: shape)?)")), group)
    for group in _EASYVQA_WORDINGS
    for wording in group
)


@functools.lru_cache(maxsize=None)
def easyvqa_paraphrases(question: str) -> tuple[str, ...]:
    """The other wordings of an easy-vqa question that keep its answer (empty if its template is unknown)."""
    for pattern, group in _EASYVQA_PATTERNS:
        match = pattern.fullmatch(question)
        if match:
            wordings = (w.format(x=match.groupdict().get("x")) for w in group)
            return tuple(w for w in wordings if w != question)
    return ()


def declares_category(key: str) -> Callable:
    """Mark a loader whose examples carry metadata[`key`] as their category: `logging.category_key: auto` then
    turns the per-category metrics and collapse detector on with that key (`loader_category`)."""

    def mark(fn: Callable) -> Callable:
        fn.category_key = key
        return fn

    return mark


def loader_category(loader: str) -> str | None:
    """The category metadata key a loader declares (`declares_category`), or None."""
    return getattr(LOADERS.get(loader), "category_key", None)


def easyvqa_question_type(answer: str) -> str:
    """ "yes/no", "shape" or "color", from the answer (the 13 answers split cleanly into these)."""
    if answer in ("yes", "no"):
        return "yes/no"
    return "shape" if answer in _EASYVQA_SHAPES else "color"


@LOADERS.register("easyvqa")
@declares_category("question_type")
def load_easyvqa(path: str | os.PathLike | None, split: str = "train") -> Iterator[Example | Skip]:
    """easy-vqa from the installed package: split "train" (38,575 questions, 4,000 images) or "test" (9,673, 1,000).

    Ids are "easyvqa-<split>-<question index, 6 digits>"; each example has one image path, its gold answer,
    the other wordings of its question as paraphrases, and metadata {"question_type", "image_id"}.
    """
    if path is not None:
        raise DataError(
            f"the 'easyvqa' loader reads the installed easy-vqa package; leave data.train.path empty (got {path})"
        )
    try:
        import easy_vqa
    except ImportError as e:
        raise DataError("the 'easyvqa' loader needs the easy-vqa package: pip install easy-vqa==1.0") from e
    readers = {
        "train": (easy_vqa.get_train_questions, easy_vqa.get_train_image_paths),
        "test": (easy_vqa.get_test_questions, easy_vqa.get_test_image_paths),
    }
    if split not in readers:
        raise DataError(f"easy-vqa has no split {split!r} (splits: train, test)")
    read_questions, read_image_paths = readers[split]
    questions, answers, image_ids = read_questions()
    image_paths = read_image_paths()
    return (
        Example(
            id=f"easyvqa-{split}-{index:06d}",
            question=question,
            images=(image_paths[image_id],),
            answer=answer,
            paraphrases=easyvqa_paraphrases(question),
            source="easyvqa",
            metadata={"question_type": easyvqa_question_type(answer), "image_id": image_id},
        )
        for index, (question, answer, image_id) in enumerate(zip(questions, answers, image_ids))
    )

"""Datasets given as Python objects (`CohortTrainer(train_dataset=..., eval_dataset=...)`), read by the "python"
loader, so that their rows go through `load_examples`' checks like any file's: a bad row is skipped, counted and
reported.

A dataset is a `datasets.Dataset`, a `datasets.IterableDataset`, a torch `IterableDataset` (of dicts) or a list of
dicts. A stream (either `IterableDataset`) is read lazily, up to `data.train.limit` (`eval.limit` for an
evaluation set), and refused without it: it may have no end. Columns default to the
loaders' record fields (`question`, `answer`, `image`/`images`, `id`, `choices`, `paraphrases`; see
`vlm_corl.data.loaders`); `columns={"question": "problem", "image": "img"}` names others. An image is a PIL
image, a path, bytes, a {"bytes", "path"} mapping, or a list of these. Every other column stays in the
example's metadata (reward functions get them as keyword arguments).

`register_dataset` keeps the object in this process under a content fingerprint and returns the
`data.train`-style options that name it: the run's config.yaml records the fingerprint, so a resume with other
data is refused like a resume with another data file. The object itself cannot be written to YAML: a config
naming the "python" loader trains only in the process that registered it (each rank of a launch runs the same
script, so each registers the same dataset).
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vlm_corl.data.loaders import FIELD_NAMES, DataError, Skip, Stream, check_columns, example_from_row
from vlm_corl.data.records import Example
from vlm_corl.registry import LOADERS

LOADER = "python"
_DATASETS: dict[str, object] = {}  # fingerprint -> the dataset object, in this process
COLUMN_ALIASES = {"image": "images"}  # a column mapping's key -> the Example field it names
LIMIT_SETTINGS = {"train_dataset": "data.train.limit", "eval_dataset": "eval.limit"}  # a stream's limit, by argument


def register_dataset(data: object, columns: Mapping[str, str] | None, argument: str) -> dict[str, Any]:
    """Keep `data` for the "python" loader; the loader options that read it ({dataset, fields, source}).
    A DataError names `argument` ("train_dataset", "eval_dataset") when the object or the mapping is unusable."""
    fields = _fields(columns, argument)
    names = _column_names(data, argument)
    if names is not None:
        check_columns(names, fields, argument, "columns")
    key = fingerprint(data)
    _DATASETS[key] = data
    return {"dataset": key, "fields": fields, "source": argument}


def _fields(columns: Mapping[str, str] | None, argument: str) -> dict[str, str]:
    if columns is None:
        return {}
    if not isinstance(columns, Mapping) or not all(isinstance(v, str) for v in columns.values()):
        raise DataError("columns must map field names to column names, e.g. {'question': 'problem'}")
    fields = {COLUMN_ALIASES.get(k, k): v for k, v in columns.items()}
    unknown = sorted(set(fields) - set(FIELD_NAMES))
    if unknown:
        raise DataError(
            f"columns: unknown field(s) {unknown} for {argument}; valid: {', '.join(['image', *FIELD_NAMES])}"
        )
    return fields


def _column_names(data: object, argument: str) -> list[str] | None:
    """The dataset's columns where it declares them (None for a list of dicts or an unknown-schema stream)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency, but a list of dicts needs none
        datasets = None
    if datasets is not None and isinstance(data, (datasets.Dataset, datasets.IterableDataset)):
        return list(data.column_names) if data.column_names is not None else None
    if isinstance(data, (list, tuple)) or _torch_stream(data):
        return None
    raise DataError(
        f"{argument} must be a datasets.Dataset, a datasets.IterableDataset or a list of dicts (or a torch "
        f"IterableDataset of dicts), got {type(data).__name__}"
    )


def _torch_stream(data: object) -> bool:
    """Whether `data` is a torch `IterableDataset` (torch is not imported for it: a script that made one has)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.utils.data.IterableDataset)


def is_stream(data: object) -> bool:
    """Whether `data` is read as a stream: a `datasets.IterableDataset` or a torch `IterableDataset`, which may
    have no end."""
    datasets = sys.modules.get("datasets")
    return (datasets is not None and isinstance(data, datasets.IterableDataset)) or _torch_stream(data)


def fingerprint(data: object) -> str:
    """A content key of the dataset: `datasets`' own fingerprint for a Dataset (a hash of its data and the
    operations that made it), a hash of the rows for a list; a stream's is its description (not its rows)."""
    import datasets

    if isinstance(data, datasets.Dataset):
        return f"ds-{data._fingerprint}"
    if isinstance(data, datasets.IterableDataset):
        info = json.dumps([data.column_names, str(data.features), data.info.dataset_name], default=str)
        return "stream-" + hashlib.sha256(info.encode()).hexdigest()[:16]
    if _torch_stream(data):  # never iterated here: it may have no end
        info = f"{type(data).__module__}.{type(data).__qualname__}"
        return "stream-" + hashlib.sha256(info.encode()).hexdigest()[:16]
    digest = hashlib.sha256()
    for row in data:
        digest.update(json.dumps(row, sort_keys=True, default=_digest_value).encode())
    return f"rows-{len(data)}-{digest.hexdigest()[:16]}"


def _digest_value(value: Any) -> str:
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    if hasattr(value, "detach"):  # a torch tensor: its repr elides the middle of a large one
        value = value.detach().cpu().numpy()
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image (or an array)
        return hashlib.sha256(value.tobytes()).hexdigest() + str(getattr(value, "shape", getattr(value, "size", "")))
    return repr(value)


@LOADERS.register(LOADER)
def load_python(
    path: str | None,
    split: str = "train",
    *,
    dataset: str,
    fields: Mapping[str, str] | None = None,
    source: str = "dataset",
    require_answer: bool = False,
) -> Iterator[Example | Skip]:
    """The rows of a dataset registered in this process by `register_dataset` (`dataset` is its fingerprint);
    `require_answer` (an evaluation set) skips rows without an answer, as "no_answer"."""
    if dataset not in _DATASETS:
        raise DataError(
            f"the {LOADER!r} loader reads a dataset given to CohortTrainer(train_dataset=..., eval_dataset=...) in "
            f"the same process, and none with fingerprint {dataset!r} was given here; run the script that passes "
            "it (a YAML config names its data with a file loader: jsonl, hf, ...)"
        )
    data = _DATASETS[dataset]
    rows = _rows(data, source, fields, require_answer)
    if is_stream(data):  # pulled a row at a time, up to the limit, which load_examples requires
        kind = f"{type(data).__module__.split('.')[0]}.{type(data).__name__}"
        return Stream(rows, f"{source} ({kind})", _limit_setting(source))
    return rows


def _limit_setting(source: str) -> str:
    return LIMIT_SETTINGS.get(source, "data.train.limit")


def _rows(data: object, source: str, fields, require_answer: bool) -> Iterator[Example | Skip]:
    import datasets

    if isinstance(data, datasets.Dataset):  # arrow rows: Image columns stay {"bytes", "path"}, not decoded
        rows = (row for batch in data.with_format("arrow").iter(batch_size=1000) for row in batch.to_pylist())
    else:
        rows = iter(data)
    for index, row in enumerate(rows):
        if isinstance(row, Mapping):
            row = {k: _encoded(v) for k, v in row.items()}
        item = example_from_row(
            row, fallback_id=f"{source}-{index:06d}", source=source, image_root=Path.cwd(), fields=fields
        )
        if require_answer and isinstance(item, Example) and item.answer is None:
            item = Skip("no_answer", f"{item.id}: an evaluation row needs an answer to be scored against")
        yield item


def _encoded(value: Any) -> Any:
    """A PIL image, or a picture as an array or tensor (`_picture`), as PNG bytes (lossless; the loaders read
    images as paths or bytes); lists likewise. An array that is no picture stays: the loader skips its row as a
    bad record naming its shape and dtype."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_encoded(v) for v in value]
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        picture = _picture(value)
        value = value if picture is None else picture
    if hasattr(value, "save") and hasattr(value, "mode") and hasattr(value, "size"):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return buffer.getvalue()
    return value


def _picture(value: Any) -> Any:
    """A numpy array or torch tensor that is a picture (uint8, HxW, HxWx1, HxWx3 or HxWx4: what
    PIL.Image.fromarray reads) as a PIL image; None for any other array (floats, channels first, ...)."""
    from PIL import Image

    array = value.detach().cpu().numpy() if hasattr(value, "detach") else value
    if str(array.dtype) != "uint8" or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (1, 3, 4))):
        return None
    return Image.fromarray(array[:, :, 0] if array.ndim == 3 and array.shape[2] == 1 else array)

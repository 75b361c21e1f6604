"""Pictures embedded in a `datasets` folder stay in its memory-mapped Arrow files (issue 58, `vlm_corl.data.mapped`):
a record holds a `TableImage` naming where its picture is, read when it is decoded, hashed or saved. The records
equal those that held the bytes, the resume fingerprint is the same digest of the same bytes, a reference pickles
small, a relaunch checks none of them again, and a dataset whose rows are not its files' rows keeps the bytes."""

from __future__ import annotations

import io
import json
import pickle
import re
from dataclasses import replace

import pytest
from PIL import Image

import vlm_corl.data.image_checks as image_checks
import vlm_corl.data.loaders as loaders
from vlm_corl.data.loaders import _hf_rows, load_examples
from vlm_corl.data.mapped import TableImage
from vlm_corl.training.run.checkpoint import data_fingerprint

datasets = pytest.importorskip("datasets")


def png(shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (shade, 0, 0)).save(buffer, "PNG")
    return buffer.getvalue()


PICTURES = [png(shade) for shade in range(0, 250, 50)]  # five distinct pictures


@pytest.fixture(scope="module")
def rows() -> dict:
    """Five records: an Image column (its second picture not a picture, its last null), a list-of-Images column
    (an empty and a null list), and a binary column."""
    image = [{"bytes": p, "path": None} for p in PICTURES[:4]] + [None]
    image[1] = {"bytes": b"junk", "path": None}
    return {
        "question": [f"what is in picture {i}?" for i in range(5)],
        "image": image,
        "gallery": [[{"bytes": PICTURES[0], "path": None}, {"bytes": PICTURES[4], "path": "x.png"}], [], None]
        + [[{"bytes": PICTURES[3], "path": None}]] * 2,
        "raw": PICTURES[::-1],
    }


FEATURES = {"image": datasets.Image(), "gallery": datasets.List(datasets.Image()), "raw": datasets.Value("binary")}


@pytest.fixture(scope="module")
def folder(rows, tmp_path_factory):
    """The records saved in two Arrow files (two shards), as `save_to_disk` writes a large dataset."""
    path = tmp_path_factory.mktemp("mapped") / "pics"
    features = datasets.Features({"question": datasets.Value("string"), **FEATURES})
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(path), num_shards=2)
    return path


def stored(rows: dict, column: str, row: int) -> tuple[bytes, ...]:
    """The bytes of a record's pictures in `column`, in order."""
    cell = rows[column][row]
    return tuple(v["bytes"] if isinstance(v, dict) else v for v in (cell if isinstance(cell, list) else [cell]))


@pytest.mark.parametrize("column", ["image", "gallery", "raw"])
def test_records_refer_to_their_pictures_in_the_mapped_files(folder, rows, column):
    loaded = load_examples("hf", folder, fields={"images": column})
    pictures = [src for ex in loaded.examples for src in ex.images]
    assert pictures and all(isinstance(src, TableImage) for src in pictures)
    assert len({src.file for src in pictures}) == 2  # both shards, each picture at its row of its file
    for ex in loaded.examples:
        assert tuple(src.read() for src in ex.images) == stored(rows, column, int(ex.id.rsplit("-", 1)[1]))
    assert all(len(pickle.dumps(src)) < 400 for src in pictures)  # a position, not a table or its bytes
    assert pickle.loads(pickle.dumps(pictures[-1])).read() == pictures[-1].read()


def test_what_is_dropped_and_why_is_what_the_bytes_gave(folder, monkeypatch):
    """The records, skips and messages equal those of the same rows with their bytes (the loader told that the
    dataset's rows are not its files': the records hold the bytes, as before): the junk picture, the null one."""
    from_files = load_examples("hf", folder)
    monkeypatch.setattr(loaders, "mapped_rows", lambda dataset, column: None)
    from_bytes = load_examples("hf", folder)
    assert all(isinstance(src, bytes) for ex in from_bytes.examples for src in ex.images)
    assert from_files.examples == from_bytes.examples  # a reference equals the bytes it refers to
    assert from_files.report.skipped == from_bytes.report.skipped == {"corrupt_image": 1, "no_image": 1}
    unaddressed = lambda report: re.sub(r"0x[0-9a-f]+", "", json.dumps(report.samples))  # noqa: E731
    assert unaddressed(from_files.report) == unaddressed(from_bytes.report)


def test_the_fingerprint_is_the_digest_of_the_same_bytes_and_a_relaunch_reads_no_picture(folder, monkeypatch):
    monkeypatch.setenv(image_checks.CACHE_ENV, str(folder.parent / "cache"))
    monkeypatch.setattr(image_checks, "_OPEN", {})
    examples = load_examples("hf", folder, fields={"images": "gallery"}).examples
    as_bytes = [replace(ex, images=tuple(src.read() for src in ex.images)) for ex in examples]
    assert data_fingerprint(examples) == data_fingerprint(as_bytes)  # the digest from the check cache
    monkeypatch.setattr(image_checks, "_OPEN", {})  # a relaunch: the cache read afresh from its file
    reads = []
    monkeypatch.setattr(TableImage, "read", lambda src: reads.append(src) or b"")
    again = load_examples("hf", folder, fields={"images": "gallery"}).examples
    assert again == examples and image_checks.pictures_checked() == 0
    assert data_fingerprint(again) == data_fingerprint(as_bytes) and reads == []


def test_a_dataset_whose_rows_are_not_its_files_rows_keeps_the_bytes(folder):
    """A selection (an indices mapping over the files) or a slice: a reference by file row would name another
    record's picture."""
    loaded = datasets.load_from_disk(str(folder))
    for subset in (loaded.select([4, 3, 2, 1, 0], keep_in_memory=True), loaded.select(range(1, 3))):
        examples = list(_hf_rows(subset, "train", "s", folder, {"images": "raw"}))
        assert [ex.images for ex in examples] == [(p,) for p in list(subset["raw"])]
        assert all(isinstance(src, bytes) for ex in examples for src in ex.images)


def test_references_of_a_sliced_column_name_each_picture_by_its_row_and_place():
    """A batch is a slice of its file's chunks: each picture is named by its row in the batch and its place in the
    cell's list; null, empty and path-only values stay as stored."""
    import pyarrow as pa

    from vlm_corl.data.mapped import references

    a, b, c = ({"bytes": x, "path": None} for x in (b"a", b"b", b"c"))
    gallery = pa.array([[a], None, [], [{"bytes": b"", "path": "p"}, b], [c]]).slice(1)
    place = lambda row, index: (row, index)  # noqa: E731
    assert references(pa.chunked_array([gallery]), place) == [
        None,
        [],
        [{"bytes": b"", "path": "p"}, {"bytes": (2, 1), "path": None}],
        [{"bytes": (3, 0), "path": None}],
    ]
    raw = pa.array([b"x", b"", None, b"y"]).slice(1)
    assert references(pa.chunked_array([raw, raw]), place) == [b"", None, (2, None), b"", None, (5, None)]

"""The picture check cache (issue 58, `vlm_corl.data.image_checks`): a relaunch decodes no picture it checked before
and reports exactly what a first load reported; a file changed in any way is checked again; the checks run in a
process pool give what they give in-process; the resume fingerprint is the same with or without the cache."""

from __future__ import annotations

import io
import os

import pytest
from cohort_helpers import ROOT, write_jsonl
from PIL import Image

import vlm_corl.data.image_checks as image_checks
import vlm_corl.data.loaders as loaders
from vlm_corl.data.loaders import load_examples
from vlm_corl.training.run.checkpoint import data_fingerprint


def png(colour: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder; `relaunch()` forgets what this process read of it (a new process)."""
    monkeypatch.setenv(image_checks.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(image_checks, "_OPEN", {})
    return lambda: monkeypatch.setattr(image_checks, "_OPEN", {})


@pytest.fixture
def decodes(monkeypatch):
    """The pictures the loaders decode, as a list of sources (one entry a decode)."""
    calls = []
    real = loaders.load_image

    def counting(src, max_pixels):
        calls.append(src)
        return real(src, max_pixels)

    monkeypatch.setattr(loaders, "load_image", counting)
    return calls


@pytest.fixture
def dataset(tmp_path):
    """Four records: two good pictures, a corrupt one, a missing one."""
    (tmp_path / "red.png").write_bytes(png("red"))
    (tmp_path / "blue.png").write_bytes(png("blue"))
    (tmp_path / "bad.png").write_bytes(png("green")[:40])
    names = ["red.png", "blue.png", "bad.png", "gone.png"]
    return write_jsonl(tmp_path / "train.jsonl", [{"id": n, "question": "what?", "image": n} for n in names])


def test_a_relaunch_decodes_nothing_checked_before_and_reports_the_same(dataset, cache, decodes):
    first = load_examples("jsonl", dataset)
    assert sorted(map(os.path.basename, decodes)) == ["bad.png", "blue.png", "gone.png", "red.png"]
    decodes.clear()
    cache()
    again = load_examples("jsonl", dataset)
    assert list(map(os.path.basename, decodes)) == ["gone.png"]  # a missing file is never cached
    assert again.examples == first.examples and again.report.as_dict() == first.report.as_dict()
    assert set(first.report.skipped) == {"corrupt_image", "missing_image"}
    assert data_fingerprint(again.examples) == data_fingerprint(first.examples)


def test_a_file_changed_in_place_is_checked_again(dataset, cache, decodes):
    assert load_examples("jsonl", dataset).report.kept == 2
    red = dataset.parent / "red.png"
    st = red.stat()
    red.write_bytes(png("green")[: st.st_size // 2].ljust(st.st_size, b"\0"))  # same size, then the same mtime
    os.utime(red, ns=(st.st_atime_ns, st.st_mtime_ns))
    cache()
    decodes.clear()
    again = load_examples("jsonl", dataset)
    assert str(red) in decodes and again.report.kept == 1
    assert again.report.skipped["corrupt_image"] == 2


def test_checks_in_a_process_pool_match_checks_in_process(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv(image_checks.CACHE_ENV, "off")
    sources = [str(tmp_path / n) for n in ("red.png", "bad.png", "gone.png")] + [png("red"), b""]
    inline = image_checks.ImageChecks(None).check(sources)
    monkeypatch.setattr(image_checks, "PARALLEL_FROM", 2)
    monkeypatch.setenv(image_checks.WORKERS_ENV, "2")
    pooled = image_checks.ImageChecks(None).check(sources)
    reasons = [None, "corrupt_image", "missing_image", None, "zero_size_image"]
    assert [p and p.reason for p in inline.values()] == [p and p.reason for p in pooled.values()] == reasons
    # the details name the same file or bytes (PIL's own text holds an object's address)
    assert [p and p.detail[:60] for p in pooled.values()] == [p and p.detail[:60] for p in inline.values()]


def test_the_fingerprint_is_the_one_computed_without_the_cache(dataset, cache, monkeypatch):
    examples = load_examples("jsonl", dataset).examples  # fills the cache with the pictures' digests
    assert image_checks.cached_digest(str(dataset.parent / "red.png")) is not None  # read from the cache
    cached = data_fingerprint(examples)
    monkeypatch.setattr(image_checks, "_OPEN", {})  # no cache read: every file hashed
    assert image_checks.cached_digest(str(dataset.parent / "red.png")) is None
    assert data_fingerprint(examples) == cached


class RecordingWorld:
    """A rank of a launch that records, at each barrier, how many pictures this process had checked."""

    def __init__(self, rank: int, log: list):
        self.rank, self.is_main, self.log = rank, rank == 0, log

    def barrier(self) -> None:
        self.log.append((self.rank, image_checks.pictures_checked()))


def test_world_rank_0_checks_the_pictures_before_the_barrier_and_the_others_read_them_after(dataset, cache):
    """`setup._load_data`: rank 0 loads, then meets the barrier; a rank after it meets the barrier first, then
    loads and decodes nothing (a fresh process: its cache view is read anew); on a data error rank 0 still meets
    the barrier (the others would wait for it forever)."""
    from vlm_corl.config import config_from_dict
    from vlm_corl.data.loaders import DataError
    from vlm_corl.training.run.setup import _load_data

    model = str(ROOT / "configs" / "models" / "internvl3-2b-hf")
    train = {"loader": "jsonl", "path": str(dataset)}
    cfg = config_from_dict(
        {"members": [{"id": "m", "model": model}], "reward": {"mode": "self_vote"}, "data": {"train": train}}
    )
    log = []
    kept = _load_data(cfg, None, RecordingWorld(0, log))[0]
    cache()
    assert _load_data(cfg, None, RecordingWorld(1, log))[0] == kept
    assert log == [(0, 4), (1, 0)] and image_checks.pictures_checked() == 1  # the missing file, checked again
    cfg.data.train.path = str(dataset.parent / "nowhere.jsonl")
    with pytest.raises(DataError):
        _load_data(cfg, None, RecordingWorld(0, log))
    assert log[-1][0] == 0

"""Dataset loaders on real data (easy-vqa, MATH-500) and on fixtures with every kind of bad record."""

import collections
import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image

import vlm_corl.data.loaders as data
from text_corl.data import MATH500_DIR
from vlm_corl.data.loaders import DataError, load_examples
from vlm_corl.registry import LOADERS

MATH500 = MATH500_DIR / "test.json"


def png(colour=(255, 0, 0), size=(8, 8)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def noise_png() -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3)).save(buf, "PNG")
    return buf.getvalue()


def write_jsonl(path: Path, lines) -> Path:
    encoded = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"\n".join(encoded) + b"\n")
    return path


def test_builtin_loaders_are_registered():
    assert {"jsonl", "hf", "easyvqa", "math500"} <= set(LOADERS.names())


# --- real data ---------------------------------------------------------------------------------------------


def test_easyvqa_train_loads_in_full_with_paraphrases_that_keep_the_answer():
    result = load_examples("easyvqa", split="train")
    examples = result.examples
    assert len(examples) == 38_575 and result.report.total_skipped == 0
    assert len({ex.images[0] for ex in examples}) == 4_000
    assert examples[123].id == "easyvqa-train-000123"
    assert {ex.source for ex in examples} == {"easyvqa"}
    types = collections.Counter(ex.metadata["question_type"] for ex in examples)
    answers = collections.Counter(ex.answer for ex in examples)
    assert types["yes/no"] == answers["yes"] + answers["no"] == 28_407
    assert types["shape"] == answers["circle"] + answers["rectangle"] + answers["triangle"]
    assert sum(types.values()) == 38_575
    # Every question has another wording, and wherever the dataset asks that wording about the same image,
    # its gold answer is the same: the groups of wordings are real paraphrases.
    assert all(ex.paraphrases and ex.question not in ex.paraphrases for ex in examples)
    gold = {(ex.metadata["image_id"], ex.question): ex.answer for ex in examples}
    checked = 0
    for ex in examples:
        for wording in ex.paraphrases:
            other = gold.get((ex.metadata["image_id"], wording))
            if other is not None:
                assert other == ex.answer, (ex, wording)
                checked += 1
    assert checked > 1_000
    assert examples[0].question_for("paraphrase:1") in examples[0].paraphrases


def test_easyvqa_test_split_and_errors():
    result = load_examples("easyvqa", split="test", limit=10)
    assert len(result.examples) == 10 and result.examples[0].id == "easyvqa-test-000000"
    assert data.easyvqa_paraphrases("what color is the shape?") == ("what is the color of the shape?",)
    with pytest.raises(DataError, match="no split 'val'"):
        load_examples("easyvqa", split="val")
    with pytest.raises(DataError, match="leave data.train.path empty"):
        load_examples("easyvqa", path="/somewhere")


def test_math500_loads_all_500_problems():
    result = load_examples("math500", MATH500, split="test")
    examples = result.examples
    assert len(examples) == 500 and result.report.total_skipped == 0
    assert len({ex.id for ex in examples}) == 500
    first = examples[0]
    assert first.id == "test/precalculus/807.json" and first.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert first.question.startswith("Convert the point $(0,3)$")
    assert first.metadata == {"source": "math", "subject": "precalculus"} and first.source == "math500"
    assert all(not ex.images and ex.answer for ex in examples)
    assert len({ex.metadata["subject"] for ex in examples}) == 7
    assert len(load_examples("math500", MATH500.parent, split="test").examples) == 500  # a directory + split


def test_math500_needs_a_readable_json_list(tmp_path):
    assert len(load_examples("math500", split="test").examples) == 500  # no path: the copy shipped in text_corl
    with pytest.raises(DataError, match="has no train.json for split 'train'"):
        load_examples("math500")
    bad = tmp_path / "test.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=f"cannot read {bad}"):
        load_examples("math500", bad)
    bad.write_text('{"prompt": "x"}')
    with pytest.raises(DataError, match="not the list"):
        load_examples("math500", bad)


# --- jsonl -------------------------------------------------------------------------------------------------


@pytest.fixture
def messy_jsonl(tmp_path):
    """A JSONL dataset with 5 good records and one record of every bad kind."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "red.png").write_bytes(png())
    (images / "blue.png").write_bytes(png((0, 0, 255)))
    cut = noise_png()
    (images / "cut.png").write_bytes(cut[: len(cut) // 2])
    (images / "junk.png").write_bytes(b"definitely not a png")
    (images / "empty.png").write_bytes(b"")
    elsewhere = tmp_path / "abs.png"
    elsewhere.write_bytes(png((0, 255, 0)))
    lines = [
        {"id": "g1", "question": "What colour?", "image": "images/red.png", "answer": "red", "type": "colour"},
        {
            "id": "g2",
            "prompt": "Same picture?",
            "images": ["images/red.png", "images/blue.png"],
            "answer": 2,
            "choices": ["yes", "no"],
            "paraphrases": ["Is it the same picture?"],
        },
        {"id": 3, "problem": "A text-only question", "answer": None},
        {"question": "No id here", "image": str(elsewhere)},
        {"id": "g5", "question": "Also red?", "image": "images/red.png", "metadata": {"k": 1}},
        {"id": "missing", "question": "q", "image": "images/nope.png"},
        {"id": "truncated", "question": "q", "image": "images/cut.png"},
        {"id": "corrupt", "question": "q", "image": "images/junk.png"},
        {"id": "zero", "question": "q", "image": "images/empty.png"},
        {"id": "blank", "question": "   ", "image": "images/red.png"},
        {"id": "noquestion", "answer": "x"},
        b'{"id": "broken", "question": ',
        b'{"id": "latin1", "question": "caf\xe9"}',
        b"",
        {"id": "g1", "question": "Duplicate of the first", "image": "images/blue.png"},
        ["not", "an", "object"],
        {"id": "badchoices", "question": "q", "choices": "abc"},
        {"id": "url", "question": "q", "image": "https://example.com/red.png"},
    ]
    return write_jsonl(tmp_path / "train.jsonl", lines)


def test_jsonl_keeps_good_records_and_counts_every_bad_one(messy_jsonl):
    result = load_examples("jsonl", messy_jsonl)
    by_id = {ex.id: ex for ex in result.examples}
    root = messy_jsonl.parent
    assert list(by_id) == ["g1", "g2", "3", f"{root.name}-train-000003", "g5"]
    assert by_id["g1"].images == (str(root / "images/red.png"),) and by_id["g1"].metadata == {"type": "colour"}
    g2 = by_id["g2"]
    assert (g2.question, g2.answer, g2.choices) == ("Same picture?", "2", ("yes", "no"))
    assert g2.question_for("paraphrase:1") == "Is it the same picture?" and len(g2.images) == 2
    assert by_id["3"].images == () and by_id["3"].answer is None
    assert by_id[f"{root.name}-train-000003"].images == (str(root / "abs.png"),)
    assert by_id["g5"].metadata == {"metadata": {"k": 1}} and by_id["g5"].source == root.name

    report = result.report
    assert report.kept == 5
    assert report.skipped == {
        "missing_image": 1,
        "corrupt_image": 2,
        "zero_size_image": 1,
        "empty_question": 2,
        "undecodable_line": 2,
        "duplicate_id": 1,
        "bad_record": 2,
        "image_url": 1,
    }
    # a record with a field of the wrong type is named by its own id; a URL is named as one, not as ROOT/https:/...
    assert report.samples["bad_record"][1] == "badchoices: choices must be a list, got str"
    assert report.samples["image_url"] == [
        "url: image 'https://example.com/red.png' is a URL; images are read from local files (download it and give "
        "its path)"
    ]
    truncated = report.samples["corrupt_image"][0]
    assert truncated.startswith("truncated: ") and "image file is truncated" in truncated
    assert report.samples["undecodable_line"][0].startswith("line 12: ")
    assert report.samples["duplicate_id"] == ["g1: id already used by an earlier record"]
    summary = report.summary()
    assert summary.splitlines()[0] == f"jsonl[train] {messy_jsonl}: kept 5, skipped 12"
    assert "  missing_image: 1 (e.g. missing: " in summary
    assert json.loads(json.dumps(report.as_dict()))["skipped"]["bad_record"] == 2


def test_each_image_is_decoded_once(messy_jsonl, monkeypatch):
    calls = collections.Counter()
    real = data.load_image

    def counting(src, max_pixels):
        calls[src] += 1
        return real(src, max_pixels)

    monkeypatch.setattr(data, "load_image", counting)
    load_examples("jsonl", messy_jsonl)
    assert calls and max(calls.values()) == 1
    assert calls[str(messy_jsonl.parent / "images/red.png")] == 1  # used by three kept records


def test_jsonl_options_directory_split_limit_fields_image_root(tmp_path):
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png())
    write_jsonl(tmp_path / "val.jsonl", [{"q": f"question {i}", "img": "a.png", "id": f"v{i}"} for i in range(5)])
    result = load_examples(
        "jsonl",
        tmp_path,
        split="val",
        limit=3,
        fields={"question": "q", "images": "img"},
        image_root=pics,
        source="toy",
    )
    assert [ex.id for ex in result.examples] == ["v0", "v1", "v2"]
    assert result.examples[0].images == (str(pics / "a.png"),) and result.examples[0].source == "toy"
    with pytest.raises(DataError, match="unknown field"):
        load_examples("jsonl", tmp_path, split="val", fields={"qestion": "q"})


def test_jsonl_unreadable_sources_are_errors_naming_the_path(tmp_path):
    absent = tmp_path / "absent.jsonl"
    with pytest.raises(DataError, match=f"{absent} does not exist"):
        load_examples("jsonl", absent)
    with pytest.raises(DataError, match=f"{tmp_path} has no test.jsonl"):
        load_examples("jsonl", tmp_path, split="test")
    with pytest.raises(DataError, match="'jsonl' loader needs a path"):
        load_examples("jsonl")
    not_jsonl = tmp_path / "picture.jsonl"
    not_jsonl.write_bytes(noise_png())
    with pytest.raises(DataError, match=f"no usable example in {not_jsonl}") as info:
        load_examples("jsonl", not_jsonl)
    assert "undecodable_line" in str(info.value)


# --- hf ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dataset():
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "problem": datasets.Value("string"),
            "image": datasets.Image(),
            "extra": datasets.List(datasets.Image()),
            "solution": datasets.Value("string"),
            "level": datasets.Value("int32"),
        }
    )
    rows = {
        "problem": ["Colour?", "Two pictures?", "Broken picture?", ""],
        "image": [
            {"bytes": png(), "path": None},
            {"bytes": png((0, 0, 255)), "path": None},
            {"bytes": b"garbage", "path": None},
            {"bytes": png(), "path": None},
        ],
        "extra": [[], [{"bytes": png((0, 255, 0)), "path": None}], [], []],
        "solution": ["red", "yes", "?", "x"],
        "level": [1, 2, 3, 4],
    }
    return datasets.Dataset.from_dict(rows, features=features)


def test_hf_save_to_disk_with_image_columns(hf_dataset, tmp_path):
    import datasets

    datasets.DatasetDict(train=hf_dataset, test=hf_dataset.select([0])).save_to_disk(tmp_path / "geo")
    fields = {"answer": "solution", "images": "image"}
    result = load_examples("hf", tmp_path / "geo", split="train", fields=fields)
    first, second = result.examples
    assert first.id == "geo-train-000000" and first.question == "Colour?" and first.answer == "red"
    assert first.images == (png(),) and first.metadata == {"extra": [], "level": 1}
    assert second.images == (png((0, 0, 255)),)
    assert result.report.skipped == {"corrupt_image": 1, "empty_question": 1}
    assert len(load_examples("hf", tmp_path / "geo", split="test", fields=fields).examples) == 1
    with pytest.raises(DataError, match="no split 'val' .*train, test"):
        load_examples("hf", tmp_path / "geo", split="val")

    hf_dataset.save_to_disk(tmp_path / "single")  # a lone Dataset, list-of-images column
    result = load_examples("hf", tmp_path / "single", fields={"images": "extra"})
    assert [len(ex.images) for ex in result.examples] == [0, 1, 0]


def test_hf_parquet_files_and_path_images(hf_dataset, tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    hf_dataset.to_parquet(str(folder / "train.parquet"))
    hf_dataset.select([1]).to_parquet(str(folder / "test.parquet"))
    cache = tmp_path / "cache"
    assert len(load_examples("hf", folder, split="test", cache_dir=cache).examples) == 1
    assert len(load_examples("hf", folder / "train.parquet", cache_dir=cache).examples) == 2

    (tmp_path / "pics").mkdir()
    (tmp_path / "pics/a.png").write_bytes(png())
    rows = [{"question": "q", "image": "pics/a.png"}, {"question": "r", "image": "pics/b.png"}]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    result = load_examples("hf", tmp_path / "rows.jsonl", cache_dir=cache)
    assert result.examples[0].images == (str(tmp_path / "pics/a.png"),)
    assert result.report.skipped == {"missing_image": 1}


def test_hf_unreadable_sources_are_errors_naming_the_path(hf_dataset, tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is no parquet file PAR1")
    with pytest.raises(DataError, match=f"cannot read {bad} as a Hugging Face dataset"):
        load_examples("hf", bad, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=f"{tmp_path / 'nothing'} does not exist"):
        load_examples("hf", tmp_path / "nothing")
    hf_dataset.save_to_disk(tmp_path / "ds")
    with pytest.raises(DataError, match=r"no column 'answer_text' \(for answer\)"):
        load_examples("hf", tmp_path / "ds", fields={"question": "problem", "answer": "answer_text"})
    hf_dataset.rename_column("problem", "text").save_to_disk(tmp_path / "noq")
    with pytest.raises(DataError, match=r"no question column .*columns: text, image"):
        load_examples("hf", tmp_path / "noq")

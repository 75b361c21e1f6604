"""Nothing a user gives us is silently dropped (issue 46), the data's part.

1. Images: a record whose image field is null lost its image; in data whose records have images, a record
   without one (null, absent or []) is skipped too. Both are counted ("no_image"), with a warning line giving
   the count; no record with an image at all (an image field null everywhere, or pictures under a misnamed
   column) is refused, naming the column expected and the columns there. Text-only data (no image field, or []
   as data_tools.prepare writes it) is not affected.
2. Streams: a `datasets.IterableDataset` or a torch `IterableDataset` is read lazily, only up to its limit, and
   refused at once without one (it may have no end), naming `data.train.limit` (`eval.limit` for an evaluation
   set); a stream whose records are all dropped ends the load, not the memory.
"""

from __future__ import annotations

import io
import itertools
import json
import logging

import pytest
import reward_fixtures
from cohort_helpers import cohort, write_jsonl
from PIL import Image

from vlm_corl.config import ConfigError, config_from_dict
from vlm_corl.config.schema import DatasetConfig
from vlm_corl.data.loaders import DataError, load_examples
from vlm_corl.data.python_data import register_dataset
from vlm_corl.training.run.setup import load_training_examples


def png(colour="red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, "PNG")
    return buf.getvalue()


def picture(colour="red") -> Image.Image:
    return Image.new("RGB", (8, 8), colour)


def load_python(data, columns=None, argument="train_dataset", **kw):
    """The rows of a dataset given to the Python API, through the loaders' checks."""
    return load_examples("python", None, **register_dataset(data, columns, argument), **kw)


def api_config(tiny_zoo, tmp_path, **train) -> dict:
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward={"mode": "none"})
    cfg["data"]["train"] = train
    cfg["rollout"]["n"] = 2
    cfg["train"]["max_steps"] = 1
    return cfg


# ---- 1. images ------------------------------------------------------------------------------------------


def _misnamed_list():
    return [{"question": f"what colour? {i}", "img": picture(), "level": i} for i in range(4)]


def _misnamed_dataset():
    import datasets

    rows = {"question": [f"what colour? {i}" for i in range(4)], "img": [png()] * 4, "level": list(range(4))}
    return datasets.Dataset.from_dict(rows).cast_column("img", datasets.Image())


@pytest.mark.parametrize("make", [_misnamed_list, _misnamed_dataset], ids=["list", "Dataset"])
def test_a_misnamed_image_column_of_a_python_dataset_is_refused_naming_it(make):
    with pytest.raises(DataError) as err:
        load_python(make())
    said = str(err.value)
    assert said.startswith("train_dataset: no record has an image under 'images' or 'image', but column 'img' ")
    assert "columns not read as an example field: img, level" in said
    assert "name it with columns={'image': 'img'}" in said
    examples = load_python(make(), {"image": "img"}).examples  # named: every question has its picture
    assert len(examples) == 4 and all(len(ex.images) == 1 for ex in examples)


def test_a_misnamed_image_column_of_a_jsonl_file_is_refused_naming_it(tmp_path):
    (tmp_path / "red.png").write_bytes(png())
    rows = [{"id": f"r{i}", "question": f"what colour? {i}", "picture": "red.png"} for i in range(3)]
    file = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=r"column 'picture' holds pictures \(e.g. record r0: 'red.png'\)") as err:
        load_examples("jsonl", file)
    assert str(err.value).startswith(f"{file}: no record has an image")
    assert "fields={'images': 'picture'} (data.train.options.fields)" in str(err.value)
    assert len(load_examples("jsonl", file, fields={"images": "picture"}).examples) == 3


def _null_list():
    return [{"question": f"what colour? {i}", "image": None, "answer": "red"} for i in range(5)]


def _null_dataset():
    import datasets

    features = datasets.Features({"question": datasets.Value("string"), "image": datasets.Image()})
    return datasets.Dataset.from_dict({"question": ["a?", "b?", "c?"], "image": [None] * 3}, features=features)


@pytest.mark.parametrize("make", [_null_list, _null_dataset], ids=["list", "Dataset"])
def test_an_image_column_null_in_every_row_is_refused_naming_the_columns(make):
    with pytest.raises(DataError) as err:
        load_python(make())
    said = str(err.value)
    assert said.startswith("train_dataset: no record has an image, though the records name one: ")
    assert "record(s) without their image (e.g. train_dataset-000000: its 'image' field is None" in said
    assert "their columns: " in said and "image, question" in said


def test_an_image_field_null_in_every_line_of_a_jsonl_file_is_refused(tmp_path):
    rows = [{"question": "q?", "image": None}, {"question": "r?", "image": ""}, {"question": "s?", "images": [None]}]
    file = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match="no record has an image, though the records name one: 3 record") as err:
        load_examples("jsonl", file)
    assert "their columns: image, images, question" in str(err.value)
    assert "fields={'images': '<column>'} (data.train.options.fields)" in str(err.value)


def test_a_null_image_among_text_records_is_skipped_and_counted(tmp_path, caplog):
    rows = [{"id": f"t{i}", "question": f"what is {i} + 1?"} for i in range(3)] + [
        {"id": "n", "question": "?", "image": None}
    ]
    with caplog.at_level(logging.WARNING, logger="vlm_corl"):
        data = load_examples("jsonl", write_jsonl(tmp_path / "train.jsonl", rows))
    assert [ex.id for ex in data.examples] == ["t0", "t1", "t2"]
    assert data.report.samples == {"no_image": ["n: its 'image' field is None"]}
    assert "1 record(s) of " in caplog.text


def test_rows_that_lost_their_image_are_skipped_counted_and_warned_text_rows_stay(caplog):
    rows = [{"question": f"what colour? {i}", "image": picture()} for i in range(6)]
    rows[1]["image"] = None  # null: the record lost its image
    rows[3]["image"] = []  # an empty list: a text-only question beside image ones (a mixed dataset)
    del rows[4]["image"]  # absent: the same
    with caplog.at_level(logging.WARNING, logger="vlm_corl"):
        data = load_python(rows)
    kept = ["train_dataset-000000", "train_dataset-000002", "train_dataset-000003", "train_dataset-000004"]
    assert [ex.id for ex in data.examples] == [*kept, "train_dataset-000005"]
    assert data.report.skipped == {"no_image": 1}
    assert data.report.samples["no_image"] == ["train_dataset-000001: its 'image' field is None"]
    assert "1 record(s) of train_dataset have lost their image (a null image field): dropped" in caplog.text


def test_a_null_image_is_dropped_and_its_place_refilled_up_to_the_limit(tmp_path):
    (tmp_path / "red.png").write_bytes(png())
    rows = [{"id": "t0", "question": "text?"}, {"id": "t1", "question": "text too?", "image": None}]
    rows += [{"id": f"i{i}", "question": f"colour {i}?", "image": "red.png"} for i in range(4)]
    data = load_examples("jsonl", write_jsonl(tmp_path / "train.jsonl", rows), limit=3)
    assert [ex.id for ex in data.examples] == ["t0", "i0", "i1"]
    assert data.report.skipped == {"no_image": 1}
    rows = [{"id": "t0", "question": "text?"}, {"id": "gone", "question": "colour?", "image": "gone.png"}]
    rows += [{"id": "i0", "question": "colour?", "image": "red.png"}]
    data = load_examples("jsonl", write_jsonl(tmp_path / "mixed.jsonl", rows))
    assert [ex.id for ex in data.examples] == ["t0", "i0"]
    assert data.report.skipped == {"missing_image": 1}


def test_text_only_data_is_not_affected(tmp_path, caplog):
    rows = [{"question": f"what is {i} + {i}?", "answer": str(2 * i), "level": "easy"} for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="vlm_corl"):
        data = load_python(rows)
        assert len(data.examples) == 5 and data.report.skipped == {}
        jsonl = load_examples("jsonl", write_jsonl(tmp_path / "train.jsonl", rows))
        assert len(jsonl.examples) == 5 and jsonl.report.skipped == {}
        prepared = [{**row, "images": []} for row in rows]  # data_tools.prepare's text records
        jsonl = load_examples("jsonl", write_jsonl(tmp_path / "prepared.jsonl", prepared))
        assert len(jsonl.examples) == 5 and jsonl.report.skipped == {}
        math = load_examples("math500", split="test")
        assert len(math.examples) == 500 and math.report.skipped == {}
    assert "no image" not in caplog.text and "dropped" not in caplog.text


def test_a_vision_cohort_given_rows_without_images_skips_and_counts_them_in_the_run_directory(tiny_zoo, tmp_path):
    rows = [{"question": f"what colour is it? {i}", "answer": "red", "image": picture()} for i in range(6)]
    rows[2]["image"] = None
    del rows[5]["image"]
    cfg = api_config(tiny_zoo, tmp_path)
    del cfg["data"]["train"]
    from vlm_corl import CohortTrainer

    summary = CohortTrainer(cfg, train_dataset=rows, reward_funcs=reward_fixtures.constant).train()
    assert summary["data"]["kept"] == 5 and summary["data"]["skipped"] == {"no_image": 1}  # row 5: a text question
    written = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    assert written["skipped"] == {"no_image": 1}
    assert written["skipped_examples"]["no_image"] == ["train_dataset-000002: its 'image' field is None"]


def test_a_vision_cohort_given_a_misnamed_image_column_is_refused_before_any_model_loads(tiny_zoo, tmp_path):
    from vlm_corl import CohortTrainer

    cfg = api_config(tiny_zoo, tmp_path)
    del cfg["data"]["train"]
    trainer = CohortTrainer(cfg, train_dataset=_misnamed_list(), reward_funcs=reward_fixtures.constant)
    with pytest.raises(DataError, match="but column 'img' holds pictures"):
        trainer.train()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_vision_cohort_given_data_without_any_picture_is_warned(tiny_zoo, tmp_path, caplog):
    """An image column absent from every row and no picture elsewhere: text data, legitimate (VL models can
    train on text), but also what a dropped image column looks like: said at start, before any model loads."""
    from vlm_corl.training.run.setup import _check_members_read_the_data

    cfg = config_from_dict(api_config(tiny_zoo, tmp_path, loader="easyvqa", limit=4))
    text = load_python([{"question": f"what colour? {i}"} for i in range(4)]).examples
    with caplog.at_level(logging.WARNING, logger="vlm_corl"):
        _check_members_read_the_data(cfg, text, None)
    assert "no training example has an image, and every member reads images" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vlm_corl"):
        _check_members_read_the_data(cfg, load_python([{"question": "q", "image": picture()}]).examples, None)
    assert "no training example has an image" not in caplog.text


# ---- 2. streams -----------------------------------------------------------------------------------------


class Endless:
    """An endless stream of rows (with an image unless `image` is None), counting the rows pulled."""

    def __init__(self, image=b"png", **columns):
        self.pulled = 0
        self.image = png() if image == b"png" else image
        self.columns = columns

    def rows(self):
        for i in itertools.count():
            self.pulled += 1
            yield {"question": f"what colour? {i}", "image": self.image, "n": i, **self.columns}


def hf_stream(source: Endless):
    import datasets

    return datasets.IterableDataset.from_generator(source.rows)


def torch_stream(source: Endless):
    import torch

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return source.rows()

    return Rows()


STREAMS = pytest.mark.parametrize("make", [hf_stream, torch_stream], ids=["datasets", "torch"])


@pytest.mark.timeout(60, func_only=True)  # the test itself: a fixture may build the zoo
@STREAMS
def test_an_endless_stream_without_a_limit_is_refused_at_start_naming_the_limit(tiny_zoo, tmp_path, make):
    from vlm_corl import CohortTrainer

    source = Endless()
    cfg = api_config(tiny_zoo, tmp_path)
    del cfg["data"]["train"]
    trainer = CohortTrainer(cfg, train_dataset=make(source), reward_funcs=reward_fixtures.constant)
    with pytest.raises(ConfigError) as err:
        trainer.train()
    assert str(err.value).startswith("invalid config: data.train.limit: train_dataset (")
    assert "is a stream with no known end" in str(err.value)
    assert "set data.train.limit to the number of examples to use" in str(err.value)
    assert len(str(err.value).splitlines()) == 1 and err.value.fields == ["data.train.limit"]
    assert source.pulled == 0


@pytest.mark.timeout(60)
@STREAMS
def test_a_stream_is_read_lazily_up_to_skip_plus_limit(make):
    source = Endless()
    options = register_dataset(make(source), None, "train_dataset")
    examples, report = load_training_examples(DatasetConfig(loader="python", skip=2, limit=5, options=options))
    assert [ex.metadata["n"] for ex in examples] == [2, 3, 4, 5, 6]
    assert report.kept == 7 and report.used == 5
    assert source.pulled <= 8  # the rows used, and at most one read ahead


@pytest.mark.timeout(60)
@STREAMS
def test_a_stream_whose_rows_are_all_dropped_ends_the_load(make):
    source = Endless(image=None)  # every row's image is null
    with pytest.raises(DataError, match="no record has an image, though the records name one: 1000 record"):
        load_python(make(source), limit=4)
    assert source.pulled <= 1001


@pytest.mark.timeout(60)
def test_an_evaluation_stream_is_read_up_to_eval_limit_and_refused_without(tmp_path):
    from vlm_corl.evaluation.scoring import Benchmark, benchmark_examples

    source = Endless(answer="red")
    options = register_dataset(hf_stream(source), None, "eval_dataset")
    bench = Benchmark("eval_dataset", "python", "test", options={**options, "require_answer": True})
    with pytest.raises(ConfigError, match="eval.limit: eval_dataset .* set eval.limit to the number of examples"):
        benchmark_examples(bench, None)
    assert [ex.metadata["n"] for ex in benchmark_examples(bench, 3)] == [0, 1, 2]
    assert source.pulled <= 4

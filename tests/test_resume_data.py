"""A resume trusts the data, not its path (issue 46, kind 4): the examples a run trains on are fingerprinted by
content (questions, answers, choices, metadata, the images' bytes) at start, recorded in the run directory and
in every checkpoint, and checked when the run resumes. Other data behind the same path (a file rewritten in
place, a relative path read from another working directory, a stream with other rows) is refused with one line
naming the data and how to go on; the same bytes through another path resume."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
import reward_fixtures
from cohort_helpers import cohort, write_jsonl

from vlm_corl import CohortTrainer
from vlm_corl.config import ConfigError, config_from_dict
from vlm_corl.data.records import Example
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.run.checkpoint import DATA_RECORD, data_fingerprint, latest_checkpoint, load_cohort_state

ROWS = [{"id": f"q{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]


@pytest.fixture(scope="module")
def first_run(tiny_zoo, tmp_path_factory):
    """One step of two text members on data.jsonl, named by a path relative to the working directory."""
    tmp = tmp_path_factory.mktemp("resume_data")
    (tmp / "first").mkdir()
    write_jsonl(tmp / "first" / "data.jsonl", ROWS)
    cfg = cohort(tmp, [("a", tiny_zoo["qwen3"]), ("b", tiny_zoo["llama"])], reward={"mode": "ring"})
    cfg["data"] = {"train": {"loader": "jsonl", "path": "data.jsonl"}, "batch_size": 2}
    cfg["rollout"]["n"] = 2
    cfg["train"].update(max_steps=1, save_every=1)
    with contextlib.chdir(tmp / "first"):
        run_cohort(config_from_dict(cfg))
    return tmp, cfg


def _resumed(first_run, tmp_path, path: str) -> dict:
    """The first run copied to tmp_path/run (a moved run directory resumes), resumed to step 2 reading `path`."""
    tmp, cfg = first_run
    shutil.copytree(tmp / "run", tmp_path / "run")
    train = {**cfg["train"], "resume": True, "max_steps": 2}
    data = {**cfg["data"], "train": {"loader": "jsonl", "path": path}}
    return {**cfg, "output_dir": str(tmp_path / "run"), "data": data, "train": train}


def test_the_data_is_recorded_at_start_and_in_every_checkpoint(first_run):
    tmp, _ = first_run
    recorded = json.loads((tmp / "run" / DATA_RECORD).read_text())
    assert recorded["examples"] == 8 and len(recorded["sha256"]) == 64
    assert recorded["path"] == str(tmp / "first" / "data.jsonl")  # resolved where the run started
    assert load_cohort_state(latest_checkpoint(tmp / "run"))["data"] == recorded


def test_the_same_bytes_through_another_relative_path_resume(first_run, tmp_path):
    """From another working directory, a relative path to the same file: the content is the same, so it resumes
    (the path alone changed)."""
    tmp, _ = first_run
    (tmp_path / "elsewhere").mkdir()
    cfg = _resumed(first_run, tmp_path, os.path.relpath(tmp / "first" / "data.jsonl", tmp_path / "elsewhere"))
    with contextlib.chdir(tmp_path / "elsewhere"):
        assert run_cohort(config_from_dict(cfg))["checkpoint"].endswith("step-2")


def test_other_bytes_behind_the_same_relative_path_are_refused(first_run, tmp_path):
    """The same `data.jsonl` read from another working directory is another file with other questions."""
    (tmp_path / "second").mkdir()
    write_jsonl(tmp_path / "second" / "data.jsonl", [{**r, "id": f"other{i}"} for i, r in enumerate(ROWS)])
    cfg = _resumed(first_run, tmp_path, "data.jsonl")
    with contextlib.chdir(tmp_path / "second"), pytest.raises(ConfigError) as err:
        run_cohort(config_from_dict(cfg))
    (problem,) = err.value.problems
    assert problem.startswith("data.train changed since ") and "other example ids" in problem
    assert str(first_run[0] / "first" / "data.jsonl") in problem and str(tmp_path / "second" / "data.jsonl") in problem
    assert "start a new run" in problem and "\n" not in problem
    assert err.value.fields == ["data.train"]
    assert latest_checkpoint(tmp_path / "run").name == "step-1"  # nothing trained on the other data


def test_a_file_rewritten_in_place_is_refused_and_resumes_once_put_back(first_run, tmp_path):
    """The same path read from the same directory, the same ids, one answer changed: refused as other content;
    the file put back: it resumes."""
    tmp, _ = first_run
    data = tmp / "first" / "data.jsonl"
    kept = data.read_bytes()
    cfg = _resumed(first_run, tmp_path, "data.jsonl")
    try:
        write_jsonl(data, [{**r, "answer": "5"} if r["id"] == "q3" else r for r in ROWS])
        with contextlib.chdir(tmp / "first"), pytest.raises(ConfigError) as err:
            run_cohort(config_from_dict(cfg))
    finally:
        data.write_bytes(kept)
    (problem,) = err.value.problems
    assert problem.startswith("data.train changed since ") and "the same 8 example ids with other content" in problem
    with contextlib.chdir(tmp / "first"):
        assert run_cohort(config_from_dict(cfg))["checkpoint"].endswith("step-2")


def test_a_stream_with_other_rows_is_refused(tiny_zoo, tmp_path):
    """A datasets.IterableDataset is named by its description (its rows are not read until the run loads them):
    another stream of the same columns is other data all the same."""
    import datasets

    def stream(word):
        rows = [{"question": f"what {word} is {i}?", "answer": "1"} for i in range(8)]
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    cfg = cohort(tmp_path, [("a", tiny_zoo["qwen3"]), ("b", tiny_zoo["llama"])], reward={"mode": "none"})
    cfg["data"]["train"] = {"limit": 8}  # a stream is read up to data.train.limit, and refused without it
    cfg["data"]["batch_size"] = 2
    cfg["rollout"]["n"] = 2
    cfg["train"].update(max_steps=1, save_every=1)
    CohortTrainer(cfg, train_dataset=stream("shape"), reward_funcs=reward_fixtures.constant).train()
    cfg["train"].update(max_steps=2, resume=True)
    with pytest.raises(ConfigError) as err:
        CohortTrainer(cfg, train_dataset=stream("colour"), reward_funcs=reward_fixtures.constant).train()
    (problem,) = err.value.problems
    assert problem.startswith("data.train changed since ") and "with other content" in problem
    assert "trained on train_dataset (loader 'python')" in problem


def test_the_fingerprint_reads_image_bytes_not_paths_or_times(tmp_path):
    """An image rewritten at the same path changes the fingerprint; the same bytes at another path, or a file
    touched (a new mtime), do not. Paraphrases may change at resume (data.paraphrases is free): not fingerprinted."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.png").write_bytes(b"\x89PNG one")
    (tmp_path / "b" / "x.png").write_bytes(b"\x89PNG one")

    def fp(folder, **kw):
        return data_fingerprint([Example("e", "what?", images=(str(tmp_path / folder / "x.png"),), **kw)])["sha256"]

    before = fp("a")
    assert fp("b") == before
    os.utime(tmp_path / "a" / "x.png", (1, 1))
    assert fp("a") == before
    assert fp("a", paraphrases=("which?",)) == before
    assert data_fingerprint([Example("e", "what?", images=(b"\x89PNG one",))])["sha256"] == before  # bytes or file
    (tmp_path / "a" / "x.png").write_bytes(b"\x89PNG two")
    assert fp("a") != before
    assert fp("b", answer="4") != before

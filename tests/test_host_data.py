"""The host plan counts the training data each rank holds (issue 58, `planning.host.data_bytes`), worked by hand
from the data files' sizes: a "jsonl" source's records (12 bytes a byte of the file; its pictures stay in their
files), an "hf" source's data files whole (each rank copies every row, pictures included, into its heap); a
source with no file here (easy-vqa's package) counts nothing. `corl plan`'s line names the data's share."""

from __future__ import annotations

import pytest
from cohort_helpers import ROOT

from vlm_corl.config import config_from_dict
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import Hardware, plan_cohort
from vlm_corl.planning.render import render_plan

INTERN = str(ROOT / "configs" / "models" / "internvl3-2b-hf")
PROCESS = 3e9  # planning/host.py HOST_PROCESS_BYTES
MIB = 2**20


def sized(path, size: int) -> None:
    """A file of `size` bytes (sparse: the plan reads sizes only)."""
    with open(path, "wb") as f:
        f.truncate(size)


def plan(train: dict):
    cfg = config_from_dict(
        {
            "members": [{"id": "m", "model": INTERN}],
            "reward": {"mode": "self_vote"},
            "data": {"batch_size": 8, "prompt_cache_mb": 100, "train": train},
            "train": {"async_checkpoint": False},
        }
    )
    return plan_cohort(cfg, Hardware(2, 80 * GB))


def test_a_jsonl_sources_records_are_counted_on_every_rank_and_its_pictures_not(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b"x" * 99_999 + b"\n")  # 100,000 bytes; never parsed by the plan
    sized(tmp_path / "big.jpg", 1_000_000)  # a picture file: read when a prompt is rendered
    host = plan({"loader": "jsonl", "path": str(tmp_path)}).host
    for rank in host.ranks:
        assert rank.init["data"] == rank.training["data"] == 12 * 100_000
    node = 2 * (PROCESS + 100 * MIB + 1_200_000) + sum(r.training.get("offload m", 0) for r in host.ranks)
    assert host.nodes() == [pytest.approx(node)]
    assert "the data (0.00 GB a rank)" in host.line()


def test_an_hf_sources_split_files_are_counted_whole(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    sized(tmp_path / "train" / "data-00000-of-00002.arrow", 300 * MIB)
    sized(tmp_path / "train" / "data-00001-of-00002.arrow", 200 * MIB)
    sized(tmp_path / "test" / "data-00000-of-00001.arrow", 50 * MIB)  # another split: not loaded
    result = plan({"loader": "hf", "path": str(tmp_path)})
    assert [r.training["data"] for r in result.host.ranks] == [500 * MIB, 500 * MIB]  # 0.52 GB (decimal GB)
    assert "the data (0.52 GB a rank)" in render_plan(result)


def test_a_source_without_files_here_counts_nothing():
    assert all("data" not in r.training for r in plan({"loader": "easyvqa"}).host.ranks)

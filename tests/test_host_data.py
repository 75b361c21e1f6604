"""The host plan counts the training data each rank holds (issue 58, `planning.host.data_bytes`), worked by hand
from the data files' sizes: a "jsonl" source's records (12 bytes a byte of the file; its pictures stay in their
files), an "hf" source's records (1,200 bytes a row of its Arrow or parquet files: its pictures stay in the mapped
files) on every rank and its data files once a node (mapped: the page cache's, shared by the node's ranks); a
source with no file here (easy-vqa's package) counts nothing. `corl plan`'s line names the data's share."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
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


def arrow(path, rows: int) -> int:
    """An Arrow stream file (as save_to_disk writes) of `rows` records with a 10 KB picture each; its size."""
    table = pa.table({"question": ["what?"] * rows, "image": [b"\xff\xd8\xff" + bytes(10_000)] * rows})
    with pa.ipc.new_stream(str(path), table.schema) as out:
        out.write_table(table)
    return path.stat().st_size


def test_an_hf_sources_records_are_counted_on_every_rank_and_its_mapped_files_once_a_node(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    size = arrow(tmp_path / "train" / "data-00000-of-00002.arrow", 300)
    size += arrow(tmp_path / "train" / "data-00001-of-00002.arrow", 200)
    (tmp_path / "train" / "state.json").write_text("{}")  # save_to_disk's: not data
    sized(tmp_path / "test" / "data-00000-of-00001.arrow", 50 * MIB)  # another split: not loaded
    result = plan({"loader": "hf", "path": str(tmp_path)})
    host = result.host
    assert [r.training["data"] for r in host.ranks] == [500 * 1200] * 2  # HF_RECORD_BYTES a row, no picture
    node = 2 * (PROCESS + 100 * MIB + 500 * 1200) + sum(r.training.get("offload m", 0) for r in host.ranks)
    assert host.mapped == size and host.nodes() == [pytest.approx(node + size)]  # the files once, not a rank
    assert "the data (0.00 GB a rank) and 0.01 GB of mapped data files a node" in render_plan(result)


def test_an_hf_sources_parquet_rows_are_read_from_its_footer(tmp_path):
    table = pa.table({"question": ["what?"] * 700, "image": [b"\xff\xd8\xff"] * 700})
    pq.write_table(table, tmp_path / "train.parquet")
    host = plan({"loader": "hf", "path": str(tmp_path / "train.parquet")}).host
    assert [r.training["data"] for r in host.ranks] == [700 * 1200] * 2
    assert host.mapped == (tmp_path / "train.parquet").stat().st_size


def test_a_source_without_files_here_counts_nothing():
    assert all("data" not in r.training for r in plan({"loader": "easyvqa"}).host.ranks)

"""`bench/data_scale.py` at its smallest size (issue 58): 8 pictures, 2 ranks (in turn in one process, each reading
the cache afresh: a process per rank costs the suite seconds of imports), launched twice. Rank 0 checks every
picture on the first launch; rank 1 (after rank 0, as `training.setup` orders them) and both ranks of the relaunch
read the checks from the cache and decode none; every rank of both launches keeps the same examples with the same
fingerprint, and a JSONL dataset's examples hold no picture bytes (paths only)."""

from __future__ import annotations

from cohort_helpers import bench_json


def test_data_scale_at_its_smallest_size_checks_each_picture_once_over_two_launches(tmp_path):
    out = bench_json("bench/data_scale.py", "--pictures", 8, "--side", 32, "--dir", tmp_path, "--in-process")
    assert (out["pictures"], out["kind"]) == (8, "jsonl") and out["picture_kb"] > 0
    ranks = out["first_launch"]["ranks"] + out["relaunch"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["pictures_checked"] for r in ranks] == [8, 0, 0, 0]
    assert {(r["examples"], r["fingerprint"], r["picture_mb"]) for r in ranks} == {(8, ranks[0]["fingerprint"], 0.0)}
    assert all(r["data_s"] >= 0 and r["data_rss_mb"] >= 0 for r in ranks)

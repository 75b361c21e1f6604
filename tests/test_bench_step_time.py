"""`bench/step_time.py` at its smallest size: it must run on main (it once broke unnoticed: a custom reward
that reads entropy never received it), and print the JSON its README documents."""

from __future__ import annotations

from cohort_helpers import bench_json


def test_step_time_benchmark_runs_at_its_smallest_size(tmp_path):
    out = bench_json(
        "bench/step_time.py",
        *("--steps", 2, "--warmup", 1, "--rounds", 1, "--prompts", 2, "--max-new-tokens", 4),
        *("--cache-dir", tmp_path / "cache"),
    )
    assert out["member_step"]["median_step_s"] > 0 and out["members"] == 2
    assert out["P"] == 2 and out["K"] == 4

"""`bench/step_audit.py` at its smallest size (issue 55 item 5): it runs, prints the JSON its docstring documents,
and each figure it audits stays at or below today's value, so that a change that adds a host sync to the update's
micro-batch or the decoder's step, operators to a decoded token, or padding to either phase shows here.

The bounds are what the audit measured once the waste it showed was cut (the update's response mask and sums, the
decoder's reads at a synchronisation, with the pinned transformers, whose Qwen2-VL forward makes 12 of the 13
syncs per micro-batch: its vision tower's grid reads and placeholder checks). Before: 21 syncs per micro-batch
with the rollout correction's sums (14 without), 0.25 per decoded step (two reads every 8 steps)."""

from __future__ import annotations

from cohort_helpers import bench_json

SYNCS_PER_MICRO_BATCH = 13  # the update, algo.rollout_is token_truncated: its sums read once per update
SYNCS_PER_DECODE_STEP = 1 / 8  # one read of the rows still decoding per synchronisation (every 8 steps on a GPU)
OPERATORS_PER_DECODE_STEP = 238.25  # aten operators per decoded token (the tiny Qwen2-VL's forward included)
ROLLOUT_FLOPS_OVER_IDEAL = 0.545  # each row alone would run its prompt itself: sharing it saves more than padding
UPDATE_FLOPS_OVER_IDEAL = 0.542


def test_step_audit_runs_at_its_smallest_size_and_no_figure_grew(tmp_path):
    out = bench_json(
        "bench/step_audit.py",
        *("--size", "smallest", "--rollout-is", "token_truncated", "--cache-dir", tmp_path / "cache"),
    )
    rollout, update = out["rollout"], out["update"]
    assert (out["P"], out["K"], out["T"]) == (2, 2, 8)
    for phase in (rollout, update):
        assert 0 < phase["flops"] and 0 < phase["ideal_flops"]
        assert phase["flops_over_ideal"] == phase["flops"] / phase["ideal_flops"]
        assert phase["syncs"] == sum(phase["sync_ops"].values()) and phase["operators"] > 0
    assert update["per_micro_batch"]["syncs"] <= SYNCS_PER_MICRO_BATCH
    assert rollout["per_step"]["syncs"] <= SYNCS_PER_DECODE_STEP
    assert rollout["per_step"]["operators"] <= OPERATORS_PER_DECODE_STEP
    assert rollout["flops_over_ideal"] <= ROLLOUT_FLOPS_OVER_IDEAL
    assert update["flops_over_ideal"] <= UPDATE_FLOPS_OVER_IDEAL
    # the boolean-mask index of the finite-logits check is gone (its nonzero was a second read)
    assert "boolean-mask indexing" not in rollout["sync_ops"]

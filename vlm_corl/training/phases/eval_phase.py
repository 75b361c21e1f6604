"""The in-loop evaluation: every member on eval.benchmarks, its questions split over the member's ranks; each
trained member's best model so far (eval.keep_best) and the eval-drop collapse warnings."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.schema import EvalConfig
from vlm_corl.distributed.world import shard
from vlm_corl.evaluation.scoring import benchmark_examples, sample_records, score_records
from vlm_corl.members.engines import make_engine
from vlm_corl.registry import BENCHMARKS
from vlm_corl.training.monitor.category_metrics import path_safe
from vlm_corl.training.monitor.collapse import describe as describe_collapse
from vlm_corl.training.monitor.collapse import eval_drops
from vlm_corl.training.run.guard import improved, save_best, write_best
from vlm_corl.training.run.setup import CohortRun

log = logging.getLogger("vlm_corl")


def eval_phase(run: CohortRun, step: int) -> list[dict]:
    """The in-loop evaluation at `step` (0: before the first update): rows to eval.jsonl and TensorBoard, each
    trained member's best model so far (eval.keep_best), and on world rank 0 the new eval-drop warnings."""
    rows = evaluate_cohort(run, run.cfg.eval, step)
    if run.cfg.eval.keep_best:
        keep_best(run, rows)
    if run.sink is None:
        return []
    run.sink.write_eval(rows)
    run.callbacks.fire("on_evaluate", step, step, rows)
    run.eval_history.extend(rows)
    max_drop = run.cfg.eval.max_category_drop
    new = [w for w in eval_drops(run.eval_history, max_drop) if w["step"] == step] if max_drop else []
    for w in new:
        log.warning(
            "possible collapse of %s in category %r at step %d: %s",
            w["slot"],
            w["category"],
            step,
            describe_collapse(w),
        )
    return new


def keep_best(run: CohortRun, rows: list[dict]) -> None:
    """Save the trained members whose score on eval.keep_best beat their best so far (every rank decides the
    same from the gathered rows; a member's ranks save together) and update best/best.json."""
    name = BENCHMARKS.get(run.cfg.eval.keep_best).name
    trained = {m.id for m in run.cfg.members if m.trainable}
    better = [r for r in improved(rows, name, run.best) if r["member"] in trained]
    if better and run.checkpoints is not None:
        run.checkpoints.written()  # a background checkpoint's thread may be writing the same modules
    for row in better:
        for m in run.members:
            if m.id == row["member"]:
                save_best(m, run.run_dir, writer=run.world.rank == run.placement[m.id][0])
        run.best[row["member"]] = {"step": row["step"], "benchmark": name, "score": row["score"]}
    run.world.barrier()
    if better and run.world.is_main:
        write_best(run.run_dir, run.best)


def evaluate_cohort(run: CohortRun, eval_cfg: EvalConfig, step: int) -> list[dict]:
    """The eval hook: every member on every configured benchmark, the questions split over the member's ranks
    (each rank answers its contiguous share, so no rank waits idle in a collective for a whole evaluation);
    one row per member and benchmark, from all its ranks' records, gathered on every rank."""
    rows = []
    for name in eval_cfg.benchmarks:
        bench = BENCHMARKS.get(name)
        if eval_cfg.max_new_tokens:
            bench = replace(bench, max_new_tokens=eval_cfg.max_new_tokens)
        bench = replace(bench, temperature=eval_cfg.temperature)
        examples = benchmark_examples(bench, eval_cfg.limit)
        shares = {}
        for m in run.members:
            engine, room = _eval_engine(run, m, bench)
            mine = shard(len(examples), run.placement[m.id], run.world.rank)
            records, answered = sample_records(
                m, examples[mine.start : mine.stop], bench, engine=engine, max_prompt_tokens=room
            )
            if member_engine(run.cfg, m.cfg) == "hf":  # its static cache freed: the next rollout's prefill comes
                engine.sleep()  # before that rollout's bucket, as the memory plan has it (its wake: a no-op)
            shares[m.id] = (records, [mine.start + i for i in answered])
        merged: dict[str, tuple[list, list]] = {}
        for part in run.world.all_gather(shares):  # rank order: a member's shards in question order
            for mid, (records, answered) in part.items():
                merged.setdefault(mid, ([], []))
                merged[mid][0].extend(records)
                merged[mid][1].extend(answered)
        for mid, (records, answered) in merged.items():
            result = score_records(records, [examples[i] for i in answered], bench)
            counts = Counter(r["type"] for r in records if r["type"] is not None)
            rows.append(
                {
                    "step": step,
                    "member": mid,
                    "benchmark": bench.name,
                    "score": result["score"],
                    "accuracy": result["accuracy"],
                    "n": result["n"],
                    "skipped_too_long": len(examples) - len(answered),
                    **{f"accuracy_{path_safe(t)}": a for t, a in result["by_type"].items()},  # tags: yes_no
                    **{f"n_{path_safe(t)}": counts[t] for t in result["by_type"]},
                }
            )
    return rows


def _eval_engine(run: CohortRun, member, bench):
    """(engine, longest prompt) for an in-loop evaluation: the member's own rollout engine, vLLM (synced after
    every update; a partitioned ZeRO-3 member has no module the HF engine could run) with what its sequence
    length leaves after the benchmark's answer, or HF (its static cache and rollout.hf_static_cache, no new
    engine's buckets beside it); an HF engine with rollout.hf_static_cache where this process has no slot of it."""
    r = run.cfg.rollout
    engine = next((s.engine for s in run.slots if s.member is member), None)
    if member_engine(run.cfg, member.cfg) != "vllm":
        return engine or make_engine("hf", member, r), 1 << 30
    return engine, r.max_prompt_tokens + r.max_new_tokens - bench.max_new_tokens

"""Put each bug of issue 32 (item 9) and issue 45 (item 7) back, run the test that pins it, and report exit code
and first message line, then the same test on the clean tree: `python tests/put_bugs_back.py [N ...]` prints one
JSON line per bug.

Each entry is (kind, file, the code as it is, the bug, the test). The file is restored after every run, also when the
run fails; run it on a clean tree (`git status`), never while other work edits the same files.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
T = "tests/test_mutations.py::"
GPU = "tests/test_gpu_schedules.py::"
BUGS = [  # kind, file, the code as it is, the bug, the test that pins it
    # kind, file, old, new, test
    (
        "rank agreement",
        "vlm_corl/training/loop.py",
        "first = run.world.all_gather(named)[0]",
        "first = named",
        T + "test_a_collapse_stop_is_taken_by_every_rank",
    ),
    (
        "rank agreement",
        "vlm_corl/training/render_ahead.py",
        "for part in run.world.all_gather(found) for i, member, tokens in part}",
        "for part in [found] for i, member, tokens in part}",
        "tests/test_long_prompts.py::test_the_ranks_of_a_member_agree_on_the_skipped_examples",
    ),
    (
        "rank agreement",
        "vlm_corl/planning/check.py",
        "free = min(world.all_gather(shutil.disk_usage(where).free))",
        "free = shutil.disk_usage(where).free",
        T + "test_every_rank_stops_when_one_ranks_disk_is_too_small",
    ),
    (
        "rank agreement",
        "vlm_corl/members/member.py",
        "sum_over(self.group, [p.grad for p in params] + [bad_loss])",
        "sum_over(self.group, [p.grad for p in params])",
        T + "test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank",
    ),
    (
        "schedule start/end",
        "vlm_corl/training/update_phase.py",
        "r.teacher_decay_start, r.teacher_decay_end)",
        "r.teacher_decay_end, r.teacher_decay_start)",
        T + "test_the_ema_teacher_moves_by_the_decay_of_its_step",
    ),
    (
        "schedule start/end",
        "vlm_corl/members/member.py",
        "num_warmup_steps=round(train.warmup_ratio * total_updates),\n            num_training_steps=total_updates,",
        "num_warmup_steps=total_updates,\n            num_training_steps=round(train.warmup_ratio * total_updates),",
        T + "test_the_learning_rate_warms_up_from_zero_then_falls_to_its_floor",
    ),
    (
        "schedule start/end",
        "vlm_corl/training/setup.py",
        "stop = spec.skip + spec.limit if spec.limit else None",
        "stop = spec.limit if spec.limit else None",
        T + "test_the_training_slice_starts_at_skip_and_holds_limit_examples",
    ),
    (
        "wrong reference",
        "vlm_corl/training/headroom.py",
        "if label is None or not any(answers_equivalent(label, a) for a in answers):",
        "if label is None or not any(answers_equivalent(gold, a) for a in answers):",
        "tests/test_headroom.py::test_reachable_headroom_needs_a_sample_that_earns_the_label_not_gold",
    ),
    (
        "wrong reference",
        "vlm_corl/training/metrics.py",
        '"agreement": _mean([float(answers_equivalent(labels[j], a, choices[j]))',
        "\"agreement\": _mean([float(answers_equivalent(gold[j] or '', a, choices[j]))",
        "tests/test_collapse.py::test_member_metrics_compare_each_diagnostic_with_its_own_reference",
    ),
    (
        "wrong reference",
        "vlm_corl/training/samples.py",
        "answers_equivalent(label, votes[m][j], ex.choices)",
        "answers_equivalent(votes[m][j], label, ex.choices)",
        T + "test_a_sampled_label_names_every_peer_whose_vote_it_counts",
    ),
    (
        "escaped braces in \\boxed{}",
        "vlm_corl/data/answers/normalize.py",
        "            i += 2  # skip the escaped character",
        "            i += 1  # skip the escaped character",
        "tests/test_answers.py",
    ),
    (
        "swapped call-site args",
        "vlm_corl/members/update.py",
        "clipped_surrogate(logp, old_logp, adv, algo.clip_low, algo.clip_high)",
        "clipped_surrogate(logp, old_logp, adv, algo.clip_high, algo.clip_low)",
        T + "test_the_ratio_is_clipped_at_one_minus_clip_low_and_one_plus_clip_high",
    ),
    (
        "swapped call-site args",
        "vlm_corl/members/update.py",
        "old_logp, _rollout_logp(mb, mask), mask, algo.rollout_is_cap",
        "_rollout_logp(mb, mask), old_logp, mask, algo.rollout_is_cap",
        T + "test_the_importance_weight_is_the_trainers_probability_over_the_engines",
    ),
    (
        "swapped call-site args",
        "vlm_corl/members/update.py",
        "kl_penalty(logp, ref_logp, algo.kl_estimator)",
        "kl_penalty(ref_logp, logp, algo.kl_estimator)",
        T + "test_the_kl_penalty_is_of_the_policy_from_its_reference",
    ),
    (
        "swapped call-site args",
        "vlm_corl/members/update.py",
        "total_tokens=norm[0], total_seqs=norm[1]",
        "total_tokens=norm[1], total_seqs=norm[0]",
        T + "test_the_micro_batch_loss_is_normalised_by_the_whole_batchs_tokens_and_responses",
    ),
    (
        "swapped call-site args",
        "vlm_corl/training/rollout_phase.py",
        "sampling_params(run.cfg, s.index, s.member.cfg.seed, step, run.shards[owner(s)].start)",
        "sampling_params(run.cfg, s.index, s.member.cfg.seed, run.shards[owner(s)].start, step)",
        T + "test_the_ranks_of_a_member_sample_with_one_seed_from_their_shards_positions",
    ),
    (
        "swapped call-site args",
        "vlm_corl/training/slots.py",
        "            cfg.data.max_image_pixels,\n            cfg.rollout.max_prompt_tokens,",
        "            cfg.rollout.max_prompt_tokens,\n            cfg.data.max_image_pixels,",
        T + "test_each_slots_renderer_gets_the_prompt_limit_and_the_image_cap",
    ),
    (
        "swapped call-site args",
        "vlm_corl/training/step_metrics.py",
        "category_step_stats(n, o.cohort, o.scored, o.categories, o.gold, unanimous)",
        "category_step_stats(n, o.cohort, o.scored, o.gold, o.categories, unanimous)",
        T + "test_the_metrics_rows_read_categories_and_gold_in_their_places",
    ),
    (
        "swapped call-site args",
        "vlm_corl/members/member.py",
        "            copied.copy_(weight)",
        "            weight.data.copy_(copied)",
        T + "test_an_ema_teachers_rollout_copy_is_refreshed_from_its_weights",
    ),
    (
        "cache eviction order",
        "vlm_corl/members/render.py",
        "self._cache.popitem(last=False)",
        "self._cache.popitem(last=True)",
        "tests/test_gpu_paths.py::test_the_prompt_cache_evicts_the_least_recently_used_prompt_not_the_oldest",
    ),
    (
        "cache eviction order",
        "vlm_corl/members/render.py",
        "            self._cache.move_to_end(example.id)",
        "            pass",
        "tests/test_gpu_paths.py::test_the_prompt_cache_evicts_the_least_recently_used_prompt_not_the_oldest",
    ),
    (
        "over-long prompt boundary",
        "vlm_corl/members/render.py",
        "if length > self.max_prompt_tokens:",
        "if length >= self.max_prompt_tokens:",
        "tests/test_long_prompts.py::test_a_prompt_of_exactly_max_prompt_tokens_is_kept_and_one_token_more_is_refused",
    ),
    (
        "over-long prompt replacements",
        "vlm_corl/data/sampler.py",
        "return kept + self._take(len(batch) - len(kept), set(kept))",
        "return self._take(len(batch) - len(kept), set(kept)) + kept",
        "tests/test_long_prompts.py::test_excluded_examples_are_replaced_by_the_next_ones_of_the_stream_in_order",
    ),
    (
        "over-long prompt replacements",
        "vlm_corl/training/render_ahead.py",
        "            if not dropped:\n                break\n"
        "            indices = run.sampler.exclude(indices, dropped)",
        "            if dropped:\n"  # the replacements rendered but not checked in turn
        "                indices = run.sampler.exclude(indices, dropped)\n"
        "                batch = [run.examples[i] for i in indices]\n"
        "                prompts, _ = render_phase(run, batch)\n"
        "            break",
        "tests/test_long_prompts.py::test_over_long_prompts_are_skipped_at_the_exact_limit_and_replaced_in_order",
    ),
    # issue 45, item 7: what only a GPU would show, through the loop (bf16 rollout copies, vLLM sleep mode) and
    # the host plan of a GPU node
    (
        "GPU schedule",
        "vlm_corl/training/update_phase.py",
        "if s.member.cfg.trainable or s.follows is not None:",
        "if s.member.cfg.trainable:",
        GPU + "test_an_ema_teacher_on_vllm_samples_from_the_ema_weights_pushed_at_the_sync",
    ),
    (
        "GPU schedule",
        "vlm_corl/members/engines/hf.py",
        "        self.member.refresh_rollout_copy()",
        "        pass",
        GPU + "test_an_ema_teachers_bf16_rollout_copy_holds_the_ema_weights_at_the_next_rollout",
    ),
    (
        "GPU schedule",
        "vlm_corl/training/update_phase.py",
        "for engine in {id(s.engine): s.engine for s in run.slots}.values():",
        "for engine in {id(s.engine): s.engine for s in run.slots if s.member.cfg.trainable}.values():",
        GPU + "test_each_engine_sleeps_for_the_update_and_only_a_trained_members_is_pushed[frozen]",
    ),
    (
        "GPU host plan",
        "vlm_corl/planning/host.py",
        "OFFLOAD_OPTIMIZER_BYTES * trained_params(m, shape) / ranks",
        "OFFLOAD_OPTIMIZER_BYTES * trained_params(m, shape)",
        "tests/test_host_plan.py::test_zero3_offload_over_the_ranks_of_one_node_holds_the_members_state_once",
    ),
    (
        "GPU host plan",
        "vlm_corl/planning/host.py",
        'adapter_sync = m.lora is not None and cfg.rollout.vllm.lora_sync == "adapter"',
        "adapter_sync = False",
        "tests/test_host_plan.py::test_a_lora_engine_serving_its_adapter_backs_its_base_up_on_the_host_while_it_sleeps",
    ),
]


def run(test: str) -> tuple[int, str]:
    """(exit code, first assertion line) of `pytest -x test`."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, next((line[2:].strip() for line in lines if line.startswith("E ")), lines[-1])[:110]


def main(only: list[str]) -> int:
    """Each chosen bug put back, its test run, the file restored, the test run again; 1 if any bug passed."""
    missed = 0
    for n, (kind, name, code, bug, test) in enumerate(BUGS):
        if only and str(n) not in only:
            continue
        path = ROOT / name
        source = path.read_text()
        assert source.count(code) == 1, f"bug {n}: the code to change is not found once in {name}"
        try:
            path.write_text(source.replace(code, bug))
            before = run(test)
        finally:
            path.write_text(source)
        after = run(test)
        missed += before[0] == 0 or after[0] != 0
        row = {"n": n, "kind": kind, "file": name, "test": test, "bug": bug.strip().splitlines()[0]}
        print(json.dumps({**row, "with_bug": before, "clean": after}), flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

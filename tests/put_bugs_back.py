"""Put each bug of issue 32 (item 9), issue 45 (item 7), issue 55 (items 2, 4, 6), issues 56-59 back, run the test
that pins it, and report exit code and first message line, then the same test on the clean tree:
`python tests/put_bugs_back.py [N ...]` prints one JSON line per bug.

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
P = "tests/test_preflight.py::"
S = "tests/test_static_decode.py::"
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
        "vlm_corl/training/phases/render_ahead.py",
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
        "vlm_corl/training/phases/update_phase.py",
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
        "vlm_corl/training/run/setup.py",
        "stop = spec.skip + spec.limit if spec.limit else None",
        "stop = spec.limit if spec.limit else None",
        T + "test_the_training_slice_starts_at_skip_and_holds_limit_examples",
    ),
    (
        "wrong reference",
        "vlm_corl/training/rewards/headroom.py",
        "if label is None or not any(answers_equivalent(label, a) for a in answers):",
        "if label is None or not any(answers_equivalent(gold, a) for a in answers):",
        "tests/test_headroom.py::test_reachable_headroom_needs_a_sample_that_earns_the_label_not_gold",
    ),
    (
        "wrong reference",
        "vlm_corl/training/monitor/metrics.py",
        '"agreement": _mean([float(answers_equivalent(labels[j], a, choices[j]))',
        "\"agreement\": _mean([float(answers_equivalent(gold[j] or '', a, choices[j]))",
        "tests/test_collapse.py::test_member_metrics_compare_each_diagnostic_with_its_own_reference",
    ),
    (
        "wrong reference",
        "vlm_corl/training/monitor/samples.py",
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
        "vlm_corl/training/phases/rollout_phase.py",
        "sampling_params(run.cfg, s.index, s.member.cfg.seed, step, run.shards[owner(s)].start)",
        "sampling_params(run.cfg, s.index, s.member.cfg.seed, run.shards[owner(s)].start, step)",
        T + "test_the_ranks_of_a_member_sample_with_one_seed_from_their_shards_positions",
    ),
    (
        "swapped call-site args",
        "vlm_corl/training/run/slots.py",
        "            cfg.data.max_image_pixels,\n            cfg.rollout.max_prompt_tokens,",
        "            cfg.rollout.max_prompt_tokens,\n            cfg.data.max_image_pixels,",
        T + "test_each_slots_renderer_gets_the_prompt_limit_and_the_image_cap",
    ),
    (
        "swapped call-site args",
        "vlm_corl/training/phases/step_metrics.py",
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
        "vlm_corl/training/phases/render_ahead.py",
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
        "vlm_corl/training/phases/update_phase.py",
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
        "vlm_corl/training/phases/update_phase.py",
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
    # issue 55, items 2, 4 and 6: the static decoder, the bf16 rollout copy and its plan, the release, background
    # checkpoints, the preflight, the GPU check's budget and the update's counts (review 4, R4-1..R4-13)
    (
        "rollout copy",
        "vlm_corl/training/run/slots.py",
        "    if samples_from_copy(member.cfg.trainable, lora, stage, engine, member.rollout_dtype, weights):",
        "    if samples_from_copy(not member.cfg.trainable, lora, stage, engine, member.rollout_dtype, weights):",
        "tests/test_static_compiled.py::test_a_trained_member_on_its_bf16_copy_decodes_statically_with_the_eager_loops_tokens[qwen2]",
    ),
    (
        "rollout copy",
        "vlm_corl/members/member.py",
        "        if self.rollout_copy is None:\n            return",
        "        if self.rollout_copy is None or self.cfg.trainable:\n            return",
        "tests/test_rollout_copy_run.py::test_a_trained_members_rollouts_sample_its_masters_through_the_bf16_copy_also_after_a_resume",
    ),
    (
        "checkpoint",
        "vlm_corl/members/member.py",
        "        _write_model(self.model, directory, state, dtype)  # the weights themselves, never the rollout copy",
        "        _write_model(self.model if self.streams_weights else self.generation_module, directory, state, dtype)",
        "tests/test_static_compiled.py::test_the_copy_follows_the_masters_at_each_sync_and_checkpoints_keep_the_masters",
    ),
    (
        "memory plan",
        "vlm_corl/planning/cohort.py",
        '        add("rollout_copy", layout.rollout_bytes * shape.params, "resident")',
        '        add("rollout_copy", layout.rollout_bytes * shape.params, "rollout")',
        "tests/test_planner_rollout_copy.py::test_a_trained_member_on_cuda_samples_from_its_copy_and_decodes_over_a_bucket",
    ),
    (
        "memory plan",
        "vlm_corl/planning/estimates.py",
        "    rows, length = bucket_rows(batch.prompts * batch.n), "
        "bucket_length(batch.prompt_tokens + batch.new_tokens)",
        "    rows, length = batch.prompts * batch.n, batch.prompt_tokens + batch.new_tokens",
        "tests/test_planner_rollout_copy.py::test_a_trained_member_on_cuda_samples_from_its_copy_and_decodes_over_a_bucket",
    ),
    (
        "memory plan",
        "vlm_corl/planning/estimates.py",
        "    return max(rollout_bytes, weights_bytes), max(rollout_bytes, weights_bytes)",
        "    return max(rollout_bytes, weights_bytes), rollout_bytes",
        "tests/test_planner_rollout_copy.py::test_a_lora_members_fp32_base_under_autocast_counts_fp32_keys_and_values",
    ),
    (
        "memory plan",
        "vlm_corl/planning/cohort.py",
        "    static = hw.cuda and use_static_cache(r.hf_static_cache, _device(True)) and _static_fits(m, shape)",
        "    static = use_static_cache(r.hf_static_cache, _device(True)) and _static_fits(m, shape)",
        "tests/test_planner_rollout_copy.py::test_no_copy_or_bucket_where_they_do_not_apply",
    ),
    (
        "host plan",
        "vlm_corl/planning/host.py",
        '        pinned = parts.get("optimizer", 0.0) * pinned_rounding(m.lora is not None, shapes[m.id])',
        '        pinned = parts.get("optimizer", 0.0)',
        "tests/test_planner_rollout_copy.py::test_pinned_checkpoint_copies_round_each_tensor_to_a_power_of_two",
    ),
    (
        "static decode memory",
        "vlm_corl/members/engines/hf.py",
        "    del prefix  #",
        "    prefix  #",
        S + "test_the_prefix_cache_is_gone_once_the_static_steps_begin",
    ),
    (
        "static decode memory",
        "vlm_corl/members/engines/hf.py",
        "        self.buckets.clear()\n",
        "",
        S + "test_an_engine_holds_one_static_cache_at_a_time_and_none_once_it_sleeps",
    ),
    (
        "static decode memory",
        "vlm_corl/members/static_decode.py",
        "            self.clear()  # first",
        "            pass  # first",
        S + "test_an_engine_holds_one_static_cache_at_a_time_and_none_once_it_sleeps",
    ),
    (
        "static decode dtype",
        "vlm_corl/members/static_decode.py",
        "reason = unwritable(unwrapped(model).config.model_type, shape) or refused.get(shape)",
        "reason = refused.get(shape)",
        S + "test_a_static_cache_that_cannot_take_a_step_s_values_is_refused_before_it_is_allocated",
    ),
    (
        "static decode ended rows",
        "vlm_corl/members/static_decode.py",
        "fed = torch.where(alive, token_ids, self.pad)[self.fill][:, None]",
        "fed = token_ids[self.fill][:, None]",
        S + "test_rows_that_end_at_different_steps_give_today_s_tokens_and_ended_rows_are_fed_the_pad",
    ),
    (
        "static decode later failure",
        "vlm_corl/members/static_decode.py",
        "            if self.calls:  # tokens",
        "            if False:  # tokens",
        S + "test_a_static_step_that_raises_after_the_first_raises",
    ),
    (
        "compile bound",
        "vlm_corl/members/static_decode.py",
        "        if len(shapes) >= MAX_SHAPES:",
        "        if False:",
        S + "test_a_process_compiles_at_most_max_shapes_static_steps",
    ),
    (
        "eval switch",
        "vlm_corl/training/phases/eval_phase.py",
        '        return engine or make_engine("hf", member, r), 1 << 30',
        '        return engine or make_engine("hf", member), 1 << 30',
        S + "test_evaluation_follows_rollout_hf_static_cache",
    ),
    (
        "eval switch",
        "vlm_corl/commands/eval.py",
        'make_engine("hf", member, RolloutConfig(hf_static_cache=args.hf_static_cache))',
        'make_engine("hf", member)',
        S + "test_evaluation_follows_rollout_hf_static_cache",
    ),
    (
        "two threads mutate one module",
        "vlm_corl/members/member.py",
        "    view = copy.copy(model)  # the live module's parameters, buffers and submodules; its own attributes",
        "    view = model",
        "tests/test_async_checkpoint.py::test_two_overlapping_saves_of_one_module_leave_it_untouched",
    ),
    (
        "overlapping writes of one member",
        "vlm_corl/training/phases/eval_phase.py",
        "        run.checkpoints.written()  # a background checkpoint's thread may be writing the same modules",
        "        pass",
        "tests/test_async_checkpoint.py::test_keep_best_waits_for_the_background_write_of_the_same_member",
    ),
    (
        "vLLM teardown of groups not its own",
        "vlm_corl/training/run/release.py",
        "        run.sink.close()\n    close_vllm_engines()\n",
        "        run.sink.close()\n",
        "tests/test_release.py::test_a_vllm_engine_tears_down_no_callers_group_and_no_group_after_a_failed_collective",
    ),
    (
        "teardown after a failed collective",
        "vlm_corl/training/run/release.py",
        "    if dist.is_initialized() and not collectives_failed(sys.exc_info()[1]):",
        "    if dist.is_initialized():",
        "tests/test_release.py::test_a_run_destroys_its_member_groups_before_letting_its_slots_go_unless_its_collectives_failed",
    ),
    (
        "graph pool outlives the run",
        "vlm_corl/training/run/release.py",
        '            if "torch._dynamo" in sys.modules:',
        "            if False:",
        "tests/test_release.py::test_on_cuda_the_release_empties_the_allocators_cache_after_collecting",
    ),
    (
        "frames kept through __context__",
        "vlm_corl/training/run/release.py",
        "        pending += [e.__cause__, e.__context__]",
        "        pending += [e.__cause__]",
        "tests/test_release.py::test_an_interrupted_runs_frames_are_cleared_through_the_exceptions_context",
    ),
    (
        "rank agreement",
        "vlm_corl/commands/preflight_checks.py",
        "verdict = self.agreement.arrive(name, failure)",
        "verdict = next((f for f in self.world.all_gather(failure) if f is not None), None)",
        P + "test_one_rank_failing_in_the_update_ends_every_rank_with_its_verdict[raise]",
    ),
    (
        "preflight timeout",
        "vlm_corl/commands/preflight_checks.py",
        "world = launch_world(options.timeout_s, need_group=cfg.train.deepspeed is not None)",
        "world = launch_world(cfg.train.dist_timeout_s, need_group=cfg.train.deepspeed is not None)",
        P + "test_preflight_collectives_wait_its_own_time_limit_and_nccl_raises",
    ),
    (
        "preflight timeout",
        "vlm_corl/commands/preflight_watch.py",
        'return {"TORCH_NCCL_BLOCKING_WAIT": "1"} if device_type == "cuda" else {}',
        "return {}",
        P + "test_preflight_collectives_wait_its_own_time_limit_and_nccl_raises",
    ),
    (
        "disk plan",
        "vlm_corl/commands/preflight_checks.py",
        'return disk.total * written["bytes"] / written["plan_bytes"]',
        'return disk.one * written["bytes"] / written["plan_bytes"]',
        P + "test_the_measured_checkpoint_disk_check_flips_at_the_runs_total",
    ),
    (
        "preflight plan",
        "vlm_corl/commands/preflight_checks.py",
        "pf.plan = small_plan(small, world, plan)",
        "pf.plan = plan",
        P + "test_plain_and_lora_members_are_ready_with_every_number",
    ),
    (
        "preflight accumulation",
        "vlm_corl/commands/preflight_checks.py",
        "MICRO_BATCHES = 2  #",
        "MICRO_BATCHES = 1  #",
        P + "test_plain_and_lora_members_are_ready_with_every_number",
    ),
    (
        "peak lookup",
        "vlm_corl/training/monitor/throughput.py",
        "    return max(found, key=lambda entry: len(entry[0]), default=None)",
        "    return found[0] if found else None",
        "tests/test_throughput.py::test_each_part_gets_its_own_peak_the_most_specific_name_first",
    ),
    (
        "metrics attribution",
        "vlm_corl/training/monitor/throughput.py",
        'if self.sampled is None or row["member"] in self.sampled:',
        "if True:",
        "tests/test_throughput.py::test_the_busy_share_goes_only_on_the_rows_of_the_slots_the_sampled_gpu_hosts",
    ),
    (
        "hang on exit",
        "vlm_corl/training/monitor/throughput.py",
        "            self.proc.kill()",
        "            self.proc.wait()",
        "tests/test_throughput.py::test_stopping_the_busy_sampler_kills_an_nvidia_smi_that_ignores_termination",
    ),
    (
        "device budget",
        "bench/gpu_check.py",
        "        elif expected > left:",
        "        elif left < 15:",
        "tests/test_bench_device.py::test_a_check_the_budget_left_cannot_cover_is_skipped_and_the_result_stays_ok",
    ),
    (
        "work count",
        "vlm_corl/members/update.py",
        "positions += ran.positions",
        "positions += sum(map(sequence_length, mb))",
        "tests/test_update_work.py::test_update_tokens_are_the_positions_the_forward_passes_ran",
    ),
    (
        "power of two",
        "vlm_corl/planning/cohort.py",
        "for size in sorted({rows, *(2**i for i in range(rows.bit_length()) if 2**i <= rows)}, reverse=True):",
        "for size in sorted({2**i for i in range(rows.bit_length()) if 2**i <= rows}, reverse=True):",
        "tests/test_update_work.py::test_auto_micro_batch_prefers_all_rows_to_the_power_of_two_below",
    ),
    (
        "sort order",
        "vlm_corl/members/update.py",
        "ordered = sorted(groups.values(), key=lambda group: max(map(sequence_length, group)))",
        "ordered = sorted(groups.values(), key=lambda group: max(map(sequence_length, group)), reverse=True)",
        "tests/test_update_work.py::test_update_micro_batches_come_in_the_exact_length_sorted_order",
    ),
    (
        "mixed devices",
        "vlm_corl/members/member.py",
        'return all(p.is_floating_point() and p.device.type in ("cuda", "meta") for p in params)',
        'return any(p.is_floating_point() and p.device.type in ("cuda", "meta") for p in params)',
        "tests/test_update_work.py::test_adamw_is_not_fused_when_some_parameters_are_on_the_host",
    ),
    (
        "host sync",
        "vlm_corl/training/rewards/grpo.py",
        "    return weights, {k: v.double() for k, v in sums.items()}",
        "    return weights, {k: torch.tensor(float(v), dtype=torch.float64) for k, v in sums.items()}",
        "tests/test_bench_step_audit.py::test_step_audit_runs_at_its_smallest_size_and_no_figure_grew",
    ),
    (
        "host sync",
        "vlm_corl/members/engines/hf.py",
        "        left = 0 if t + 1 == limit else int(alive.sum())  # one read from the device per synchronisation",
        "        left = 0 if t + 1 == limit or not bool(alive.any()) else int(alive.sum())",
        "tests/test_bench_step_audit.py::test_step_audit_runs_at_its_smallest_size_and_no_figure_grew",
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


# issue 56: settings that apply, the researchers' figures, each objective's own fields, preflight's inputs, the
# schema, model cards, array images, resume advice, the report, the command names
I56A = "tests/test_config_applies.py::"
I56M = "tests/test_metrics_fields.py::"
I56O = "tests/test_objectives_train.py::"
BUGS += [
    (
        "config field rule",
        "vlm_corl/config/applies.py",
        '    _objective_rule("algo.cispo_max_weight", "cispo"),\n',
        "",
        I56A + "test_every_schema_field_applies_always_or_has_a_rule_with_its_test",
    ),
    (
        "config field rule",
        "vlm_corl/config/loading.py",
        "warnings = [message for _, message in inapplicable(cfg)]",
        "warnings = []",
        I56A + "test_the_warning_says_what_applies_instead",
    ),
    (
        "config field rule",
        "vlm_corl/config/applies.py",
        "lambda c: c.algo.kl_beta > 0,",
        "lambda c: c.algo.kl_beta >= 0,",
        I56A + "test_a_field_that_does_not_apply_warns_once_and_one_that_applies_never",
    ),
    (
        "config field rule",
        "vlm_corl/config/applies.py",
        "if value != default and value not in rule.off",
        "if value not in rule.off",
        I56A + "test_defaults_and_values_that_ask_for_what_the_run_does_anyway_never_warn",
    ),
    (
        "other tools' names",
        "vlm_corl/config/parse.py",
        "    if said is not None:\n",
        "    if False:\n",
        I56A + "test_dapo_points_to_the_token_mean_aggregation_not_sapo",
    ),
    (
        "refused combination",
        "vlm_corl/config/loading.py",
        "    _adapter_rank_problems(cfg, i, m, problems)\n",
        "",
        I56A + "test_an_adapter_rank_vllm_cannot_serve_is_refused_before_any_model_loads",
    ),
    (
        "preflight warns of the user's config",
        "vlm_corl/commands/preflight_checks.py",
        "pf.run = start_run(small, warn_config=False)",
        "pf.run = start_run(small)",
        "tests/test_preflight.py::test_plain_and_lora_members_are_ready_with_every_number",
    ),
    (
        "clip side",
        "vlm_corl/training/rewards/grpo.py",
        "low, high = active & (adv < 0), active & (adv > 0)",
        "low, high = active & (adv > 0), active & (adv < 0)",
        I56M + "test_the_updates_clip_fractions_are_the_second_passs_ratios_set_by_its_first_step",
    ),
    (
        "clip level",
        "vlm_corl/training/rewards/grpo.py",
        '    if policy_loss == "gspo":\n        active = active.any(dim=-1, keepdim=True)\n',
        "",
        I56M + "test_gspo_counts_sequences_and_cispo_counts_capped_weights_all_high_and_sapo_nothing",
    ),
    (
        "clip level",
        "vlm_corl/members/update.py",
        'n = max((totals[1] if algo.policy_loss == "gspo" else totals[0]) * passes, 1)',
        "n = max(totals[0] * passes, 1)",
        I56O + "test_a_short_run_trains_with_each_objective_and_correction_and_logs_its_figures",
    ),
    (
        "entropy denominator",
        "vlm_corl/members/update.py",
        '"entropy_tokens": mask.sum().double()',
        '"entropy_tokens": torch.ones_like(mask).sum().double()',
        I56M + "test_kl_and_entropy_of_one_update_equal_an_independent_computation",
    ),
    (
        "entropy pass",
        "vlm_corl/members/update.py",
        "logp, mask, ran = _logprobs(member, mb, policy, entropy=old_logp is None)",
        "logp, mask, ran = _logprobs(member, mb, policy)",
        I56M + "test_kl_and_entropy_of_one_update_equal_an_independent_computation",
    ),
    (
        "kl denominator",
        "vlm_corl/members/update.py",
        'out["kl"] = summed["ref_kl"] / max(totals[0] * passes, 1)',
        'out["kl"] = summed["ref_kl"] / max(totals[1] * passes, 1)',
        I56M + "test_kl_and_entropy_of_one_update_equal_an_independent_computation",
    ),
    (
        "rank min/max",
        "vlm_corl/training/phases/step_metrics.py",
        'for key, pick in (("is_ratio_min", min), ("is_ratio_max", max)):',
        'for key, pick in (("is_ratio_min", max), ("is_ratio_max", min)):',
        I56M + "test_the_importance_ratio_before_the_cap_and_its_extremes_over_the_ranks",
    ),
    (
        "ratio before the cap",
        "vlm_corl/training/rewards/grpo.py",
        "        **_uncapped_ratio(delta, finite, mode),",
        "        **_uncapped_ratio(weights.log(), finite, mode),",
        I56M + "test_the_importance_ratio_before_the_cap_and_its_extremes_over_the_ranks",
    ),
    (
        "metric missing",
        "vlm_corl/training/monitor/metrics.py",
        '        "zero_variance_frac": zero_variance_frac(rewards),\n',
        "",
        I56O + "test_a_short_run_trains_with_each_objective_and_correction_and_logs_its_figures",
    ),
    (
        "equal rewards before resampling",
        "vlm_corl/training/phases/reward_phase.py",
        "    before = [zero_variance_frac(r) for r in rolled.scored.rewards]\n    rolled, counts = resample(",
        "    rolled, counts = resample(",
        "tests/test_dynamic_sampling_runs.py::test_a_run_trains_on_the_questions_the_data_stream_gives_after_resampling",
    ),
    (
        "objective's own field",
        "vlm_corl/members/update.py",
        "cispo_loss(logp, old_logp, adv, algo.cispo_max_weight)",
        "cispo_loss(logp, old_logp, adv, 1 + algo.clip_high)",
        "tests/test_grpo_objectives.py::test_each_objective_reads_its_own_fields",
    ),
    (
        "objective's own field",
        "vlm_corl/training/phases/reward_phase.py",
        "return [trainable[s.member_id] and not s.teacher for s in run.specs]",
        "return [trainable[s.member_id] for s in run.specs]",
        "tests/test_dynamic_sampling.py::test_under_ema_teachers_only_the_students_decide",
    ),
    (
        "objective's own field",
        "vlm_corl/training/phases/update_phase.py",
        "            None if masked is None else [masked[n] for n in trained],\n",
        "",
        "tests/test_dynamic_sampling_runs.py::test_masking_truncated_responses_trains_on_fewer_tokens",
    ),
    (
        "path-safe category key",
        "vlm_corl/training/monitor/category_metrics.py",
        'prefix = f"category/{path_safe(category)}/"',
        'prefix = f"category/{category}/"',
        "tests/test_category_keys.py::test_a_category_is_one_level_of_every_key_and_tag",
    ),
    (
        "path-safe category key",
        "vlm_corl/reporting/run_plots.py",
        "safe = path_safe(category)",
        "safe = category",
        "tests/test_category_keys.py::test_the_report_names_the_category_as_it_is_and_joins_old_rows",
    ),
    (
        "path-safe category key",
        "vlm_corl/training/phases/eval_phase.py",
        '**{f"accuracy_{path_safe(t)}": a',
        '**{f"accuracy_{t}": a',
        "tests/test_collapse_guard.py::test_a_category_collapse_is_flagged_and_the_guard_rolls_back",
    ),
    (
        "report integer steps",
        "vlm_corl/reporting/run_plots.py",
        "    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at 1.25",
        "    pass",
        "tests/test_report.py::test_the_update_numbers_get_a_plot_and_table_rows_and_steps_tick_as_whole_numbers",
    ),
    (
        "report title cut",
        "vlm_corl/reporting/run_plots.py",
        "fig.suptitle(literal(title), wrap=True)  # one plot",
        "fig.suptitle(literal(title))  # one plot",
        "tests/test_report_html.py::test_update_curves_whole_steps_whole_titles_and_a_word_for_each_missing_plot",
    ),
    (
        "report empty plot",
        "vlm_corl/reporting/html.py",
        'if draw_metric(fig.add_subplot(), pairs, "v", look):',
        'if draw_metric(fig.add_subplot(), pairs, "v", look) or True:',
        "tests/test_report_html.py::test_update_curves_whole_steps_whole_titles_and_a_word_for_each_missing_plot",
    ),
    (
        "report update curves",
        "vlm_corl/reporting/markdown.py",
        '("entropy", "kl", "clip_frac", "clip_frac_low", "clip_frac_high"),',
        '("kl",),',
        "tests/test_report.py::test_the_update_numbers_get_a_plot_and_table_rows_and_steps_tick_as_whole_numbers",
    ),
    (
        "preflight inputs",
        "vlm_corl/commands/preflight.py",
        "    check_paths(out, Path(cfg.output_dir))\n",
        "",
        "tests/test_preflight_inputs.py::test_an_out_that_is_a_directory_is_refused_before_any_load",
    ),
    (
        "preflight inputs",
        "vlm_corl/commands/preflight_checks.py",
        'return f"{err.filename or out}: {err.strerror or err}"',
        "raise",
        "tests/test_preflight_inputs.py::test_a_report_that_cannot_be_written_returns_why",
    ),
    (
        "array images",
        "vlm_corl/data/loaders.py",
        "return value is None or (isinstance(value, str) and not value)",
        'return value is None or value == ""',
        "tests/test_array_images.py::test_uint8_arrays_and_tensors_are_pictures_and_other_arrays_are_skipped_with_their_shape",
    ),
    (
        "array images",
        "vlm_corl/data/python_data.py",
        "value = value if picture is None else picture",
        "value = value",
        "tests/test_array_images.py::test_uint8_arrays_and_tensors_are_pictures_and_other_arrays_are_skipped_with_their_shape",
    ),
    (
        "resume advice",
        "vlm_corl/training/run/setup.py",
        "            if _held_run(held)\n",
        "            if False\n",
        "tests/test_resume_advice.py::test_the_advice_of_a_resume_without_a_checkpoint_starts_the_run",
    ),
    (
        "config schema",
        "vlm_corl/config/json_schema.py",
        '"additionalProperties": False,',
        '"additionalProperties": True,',
        "tests/test_config_schema.py::test_every_field_carries_its_help_default_bounds_and_choices",
    ),
    (
        "model card header",
        "vlm_corl/reporting/model_card.py",
        'library_name="peft" if adapter else "transformers",',
        'library_name="transformers",',
        "tests/test_export_card.py::test_the_cards_header_names_the_hub_base_an_adapters_library_and_the_newest_evaluation",
    ),
    (
        "model card header",
        "vlm_corl/reporting/model_card.py",
        'newest = {r["benchmark"]: r for r in sorted(rows, key=lambda r: r["step"])}',
        'newest = {r["benchmark"]: r for r in rows[:1]}',
        "tests/test_export_card.py::test_the_cards_header_names_the_hub_base_an_adapters_library_and_the_newest_evaluation",
    ),
    (
        "python -m vlm_corl",
        "vlm_corl/__main__.py",
        "sys.exit(main())",
        "",
        "tests/test_python_m_corl.py::test_python_m_vlm_corl_runs_corl",
    ),
    (
        "usage names corl",
        "vlm_corl/commands/__init__.py",
        '    cli.invoked_as = f"corl {command}"\n',
        "",
        "tests/test_cli.py::test_a_command_run_as_corl_name_says_so_in_its_usage",
    ),
    (
        "config schema",
        "vlm_corl/config/json_schema.py",
        'out["pattern"] = f"^(?:{meta[\'pattern\'][0]})$"',
        'out["pattern"] = meta["pattern"][0]',
        "tests/test_config_schema.py::test_a_bad_cohort_file_fails_the_schema_as_the_parser_refuses_it",
    ),
]
# issue 57: two nodes, torchrun's restarts, a lost node
BUGS += [
    (
        "elastic restart",
        "vlm_corl/distributed/world.py",
        "            store=attempt_store(rank, size, timedelta(seconds=timeout_s)),",
        "            store=None,",
        "tests/test_multinode.py::test_a_group_torchrun_restarts_starts_from_an_empty_store",
    ),
    (
        "lost node report",
        "vlm_corl/distributed/world.py",
        "    store = _store() if world.distributed and store_answers() else None",
        "    store = _store() if world.distributed else None",
        "tests/test_multinode.py::test_a_lost_node_is_reported_by_the_other_within_the_timeout_and_the_job_resumes",
    ),
    (
        "lost node report",
        "vlm_corl/distributed/world.py",
        "        who = lost_store_node(members)",
        "        pass",
        "tests/test_multinode.py::test_a_lost_node_is_reported_by_the_other_within_the_timeout_and_the_job_resumes",
    ),
    (
        "launcher death",
        "vlm_corl/distributed/world.py",
        "        if not store_answers():  # asked first: a call on a store whose server is gone prints pages of C++ "
        "frames",
        "        if False:",
        "tests/test_multinode.py::test_the_launchers_own_death_is_reported_by_its_workers_without_cpp_frames",
    ),
]
# issues 58 (the picture-check cache, the host plan's data) and 59 (stop strings, paraphrase settings)
BUGS += [
    (
        "stale picture check",
        "vlm_corl/data/image_checks.py",
        'return f"file:{path}\\0{st.st_dev}\\0{st.st_ino}\\0{st.st_size}\\0{st.st_mtime_ns}\\0{st.st_ctime_ns}"',
        'return f"file:{path}\\0{st.st_dev}\\0{st.st_ino}\\0{st.st_size}\\0{st.st_mtime_ns}"',
        "tests/test_image_checks.py::test_a_file_changed_in_place_is_checked_again",
    ),
    (
        "uncached picture check",
        "vlm_corl/data/image_checks.py",
        "missing = [src for src, key in keys.items() if key is None or key not in self.entries]",
        "missing = list(keys)",
        "tests/test_image_checks.py::test_a_relaunch_decodes_nothing_checked_before_and_reports_the_same",
    ),
    (
        "pool results out of order",
        "vlm_corl/data/image_checks.py",
        "return list(self._pool.map(functools.partial(check_image, load=load), sources, chunksize=chunk))",
        "return list(self._pool.map(functools.partial(check_image, load=load), sources[::-1], chunksize=chunk))",
        "tests/test_image_checks.py::test_checks_in_a_process_pool_match_checks_in_process",
    ),
    (
        "fingerprint from cache",
        "vlm_corl/data/image_checks.py",
        "return bytes.fromhex(entry[0]) if entry else None",
        "return bytes.fromhex(entry[0])[::-1] if entry else None",
        "tests/test_image_checks.py::test_the_fingerprint_is_the_one_computed_without_the_cache",
    ),
    (
        "pictures checked uncounted",
        "vlm_corl/data/image_checks.py",
        "        self.checked += len(missing)\n",
        "",
        "tests/test_bench_data_scale.py::test_data_scale_at_its_smallest_size_checks_each_picture_once_over_two_launches",
    ),
    (
        "rank 0 loads first",
        "vlm_corl/training/run/setup.py",
        "    if not world.is_main:\n        world.barrier()\n    try:",
        "    try:",
        "tests/test_image_checks.py::test_world_rank_0_checks_the_pictures_before_the_barrier_and_the_others_read_them_after",
    ),
    (
        "host data",
        "vlm_corl/planning/host.py",
        "return RECORD_BYTES_PER_JSONL_BYTE * file.stat().st_size if file.is_file() else 0.0",
        "return file.stat().st_size if file.is_file() else 0.0",
        "tests/test_host_data.py::test_a_jsonl_sources_records_are_counted_on_every_rank_and_its_pictures_not",
    ),
    (
        "host data",
        "vlm_corl/planning/host.py",
        "folder = path / spec.split if (path / spec.split).is_dir() else path  # a DatasetDict's split",
        "folder = path",
        "tests/test_host_data.py::test_an_hf_sources_records_are_counted_on_every_rank_and_its_mapped_files_once_a_node",
    ),
    (
        "stop strings",
        "vlm_corl/members/engines/hf.py",
        "        for step in range(t, start - 1, -1):  # backwards: the first hit is written last",
        "        for step in range(start, t + 1):  # backwards: the first hit is written last",
        "tests/test_stop_strings.py::test_a_stop_ends_a_row_at_the_first_token_whose_bytes_complete_it[qwen2]",
    ),
    (
        "stop strings",
        "vlm_corl/members/engines/hf.py",
        "        first = max(0, start - self.window + 1)",
        "        first = start",
        "tests/test_stop_strings.py::test_a_stop_ends_a_row_at_the_first_token_whose_bytes_complete_it[qwen2]",
    ),
    (
        "stop strings",
        "vlm_corl/members/engines/hf.py",
        "            ends = self.criteria(span[:, : step + 1 - first], None) & (step < own)",
        "            ends = self.criteria(span[:, : step + 1 - first], None)",
        "tests/test_stop_strings.py::test_a_stop_ends_a_row_at_the_first_token_whose_bytes_complete_it[qwen2]",
    ),
    (
        "stop strings",
        "vlm_corl/members/engines/hf.py",
        "        return bool(self.criteria(torch.tensor([row[-self.window :]]), None)[0])",
        "        return bool(self.criteria(torch.tensor([row[-1:]]), None)[0])",
        "tests/test_stop_strings.py::test_a_stop_ends_a_row_at_the_first_token_whose_bytes_complete_it[qwen2]",
    ),
    (
        "paraphrase provenance",
        "data_tools/paraphrase.py",
        '            "samples": self.params.n,',
        '            "samples": self.n,',
        "tests/test_paraphrase.py::test_tool_resumes_without_redoing_finished_rows",
    ),
]
# issue 58: an hf dataset's embedded pictures as references into its memory-mapped Arrow files
BUGS += [
    (
        "mapped picture digest",
        "vlm_corl/training/run/checkpoint.py",
        "    if isinstance(image, TableImage):  # the digest of the bytes it refers to, as when the record held them\n"
        "        return cached_digest(image) or hashlib.sha256(image.read()).digest()\n",
        "",
        "tests/test_mapped_pictures.py::test_the_fingerprint_is_the_digest_of_the_same_bytes_and_a_relaunch_reads_no_picture",
    ),
    (
        "uncached mapped picture",
        "vlm_corl/data/image_checks.py",
        'return f"{src.stamp}\\0{src.row}\\0{src.column}\\0{src.index}"',
        "return None",
        "tests/test_mapped_pictures.py::test_the_fingerprint_is_the_digest_of_the_same_bytes_and_a_relaunch_reads_no_picture",
    ),
    (
        "mapped rows",
        "vlm_corl/data/mapped.py",
        "    if dataset._indices is not None:\n        return None\n",
        "",
        "tests/test_mapped_pictures.py::test_a_dataset_whose_rows_are_not_its_files_rows_keeps_the_bytes",
    ),
    (
        "mapped rows",
        "vlm_corl/data/mapped.py",
        "    if sum(t.num_rows for t in tables) != dataset.num_rows or any(",
        "    if any(",
        "tests/test_mapped_pictures.py::test_a_dataset_whose_rows_are_not_its_files_rows_keeps_the_bytes",
    ),
    (
        "mapped rows",
        "vlm_corl/data/mapped.py",
        "        return files[k][0], row - starts[k]",
        "        return files[k][0], row",
        "tests/test_mapped_pictures.py::test_records_refer_to_their_pictures_in_the_mapped_files[image]",
    ),
    (
        "reference equals its bytes",
        "vlm_corl/data/mapped.py",
        "        if isinstance(other, bytes):\n            return self.read() == other\n",
        "",
        "tests/test_mapped_pictures.py::test_what_is_dropped_and_why_is_what_the_bytes_gave",
    ),
    (
        "sliced list column",
        "vlm_corl/data/mapped.py",
        "    values = _pictures(chunk.values.slice(first, offsets[-1] - first), places, refer)",
        "    values = _pictures(chunk.values, places, refer)",
        "tests/test_mapped_pictures.py::test_references_of_a_sliced_column_name_each_picture_by_its_row_and_place",
    ),
    (
        "pictures copied per rank",
        "vlm_corl/data/loaders.py",
        "        for row in batch.to_pylist() if refer is None else _rows_referring(batch, index, refer):",
        "        for row in batch.to_pylist():",
        "tests/test_mapped_pictures.py::test_records_refer_to_their_pictures_in_the_mapped_files[image]",
    ),
    (
        "host data",
        "vlm_corl/planning/host.py",
        "        out = [self.mapped] * (-(-len(self.ranks) // per))",
        "        out = [0.0] * (-(-len(self.ranks) // per))",
        "tests/test_host_data.py::test_an_hf_sources_records_are_counted_on_every_rank_and_its_mapped_files_once_a_node",
    ),
    (
        "host data",
        "vlm_corl/planning/host.py",
        "        return HF_RECORD_BYTES * sum(map(_rows, tables)) + RECORD_BYTES_PER_JSONL_BYTE * texts",
        "        return float(sum(f.stat().st_size for f in files))",
        "tests/test_host_data.py::test_an_hf_sources_records_are_counted_on_every_rank_and_its_mapped_files_once_a_node",
    ),
]


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
        row = {
            "n": n,
            "kind": kind,
            "file": name,
            "test": test,
            "bug": (bug.strip().splitlines() or ["(the code removed)"])[0],
        }
        print(json.dumps({**row, "with_bug": before, "clean": after}), flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

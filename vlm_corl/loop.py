"""The cohort training loop: one short function of named, timed phases.

sample → render → rollout → extract → exchange → reward → advantage → update → log → checkpoint → eval
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from vlm_corl.answers import extract_answer
from vlm_corl.checkpoint import latest_checkpoint, load_cohort_state, save_checkpoint, set_rng_states
from vlm_corl.cohort import Slot, build_slots, check_views, ema_update, models_to_save, teacher_decay
from vlm_corl.collapse import collapse_warnings, flag_step
from vlm_corl.config import CohortConfig, save_config
from vlm_corl.data import load_examples
from vlm_corl.eval import benchmark_examples, evaluate_member
from vlm_corl.exchange import exchange
from vlm_corl.grpo import group_advantages, nonzero_variance_groups
from vlm_corl.member import load_member
from vlm_corl.metrics import MetricsSink, cohort_metrics, member_metrics
from vlm_corl.paraphrases import apply_paraphrases, read_cache
from vlm_corl.registry import BENCHMARKS
from vlm_corl.rewards import CohortBatch, RewardSpec, resolve_reward
from vlm_corl.rollout import SamplingParams
from vlm_corl.sampler import LockstepSampler
from vlm_corl.update import Sequence, policy_update, response_token_stats

log = logging.getLogger("vlm_corl")

FORMAT_PATTERNS = {"boxed": "\\boxed{", "answer_tags": "<answer>"}


class PhaseTimer:
    """Wall-clock seconds per named phase of the current step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def sampling_params(cfg: CohortConfig, member_index: int, member_seed: int, step: int) -> SamplingParams:
    """A member's sampling parameters at `step`; its seed is a pure function of (run, member, step), so a
    resumed run samples exactly what the uninterrupted one would have."""
    r = cfg.rollout
    seed = (cfg.seed * 1_000_003 + (member_index * 7919 + member_seed) * 104_729 + step) % (2**63)
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, stop=tuple(r.stop), seed=seed)


def format_ok(text: str, style: str) -> bool:
    """Does a response use the member's answer format (a format reward's input)?"""
    return FORMAT_PATTERNS[style] in text


@dataclass
class CohortRun:
    """Everything a run holds between steps: data order, members, their slots (engines, renderers), sinks."""

    cfg: CohortConfig
    run_dir: Path
    examples: list
    sampler: LockstepSampler
    members: list  # the configured members (trained, or frozen peers)
    slots: list[Slot]  # who renders, rolls out and gets a label this step (vlm_corl.cohort)
    sink: MetricsSink
    reward_spec: RewardSpec
    start: int
    history: list[dict]  # metrics rows so far (restored from metrics.jsonl on resume)


def run_cohort(cfg: CohortConfig) -> dict:
    """Train the cohort described by `cfg`; returns the summary also written to summary.json."""
    run = start_run(cfg)
    slots = run.slots
    const_norm = cfg.algo.drgrpo_norm or cfg.rollout.max_new_tokens
    bar = tqdm(range(run.start, cfg.train.max_steps), initial=run.start, total=cfg.train.max_steps,
               disable=not cfg.logging.progress, desc="cohort", dynamic_ncols=True)
    history = run.history
    # The next batch is rendered (images decoded and preprocessed) in a background thread while this step
    # rolls out and updates; the render phase then only collects it from the renderers' caches.
    prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")
    prefetch = None
    for step in bar:
        step_start = time.perf_counter()
        timer = PhaseTimer()
        with timer("sample"):
            batch = [run.examples[i] for i in run.sampler.next_batch()]
        with timer("render"):
            if prefetch is not None:
                prefetch.result()
            prompts = [[s.renderer(ex) for ex in batch] for s in slots]
            if step + 1 < cfg.train.max_steps:
                upcoming = [run.examples[i] for i in run.sampler.peek_batch()]
                prefetch = prefetcher.submit(lambda exs=upcoming: [s.renderer(ex) for s in slots for ex in exs])
        with timer("rollout"):
            groups, rollout_s = rollout_phase(cfg, slots, prompts, step)
        with timer("extract"):
            answers, formats = extract_phase(cfg, slots, groups, batch)
        with timer("exchange"):
            local = {s.id: {g.prompt.example_id: (a, f, [r.text for r in g.responses]) for g, a, f in zip(gs, ans, fmt)}
                     for s, gs, ans, fmt in zip(slots, groups, answers, formats)}
            answers, formats, texts = exchange([ex.id for ex in batch], local, [s.id for s in slots])
        with timer("reward"):
            gold = [ex.answer for ex in batch]
            cohort = CohortBatch(
                member_ids=tuple(s.id for s in slots), answers=answers, format_ok=formats, texts=texts,
                choices=[ex.choices for ex in batch],
                gold=gold if run.reward_spec.uses_gold else [None] * len(batch),  # labels reach `gt` only
                scores=intrinsic_scores(cfg, slots, groups) if run.reward_spec.needs_scores else {},
            )
            scored = run.reward_spec.fn(cohort, cfg.reward)
        with timer("advantage"):
            advantages = [group_advantages(scored.rewards[n], cfg.algo.scale_rewards, cfg.algo.adv_eps)
                          for n in range(len(slots))]
        with timer("update"):
            updates = update_phase(cfg, run.members, slots, groups, advantages, scored.rewards, const_norm, step)
        with timer("log"):
            rows = _rows(step + 1, slots, groups, cohort, scored, gold, updates, rollout_s, history,
                         cfg.reward.vote_threshold)
            history.extend(rows)
            bar.set_postfix(reward=" ".join(f"{r['reward_mean']:.2f}" for r in rows))
        if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0 or step + 1 == cfg.train.max_steps:
            with timer("checkpoint"):
                save_checkpoint(run.run_dir, step + 1, models_to_save(slots), {"sampler": run.sampler.state_dict()},
                                cfg.train.keep_last)
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            with timer("eval"):
                run.sink.write_eval(evaluate_cohort(run.members, cfg.eval, step + 1))
        if (step + 1) % cfg.logging.log_every == 0:
            times = {f"time_{k}": v for k, v in timer.seconds.items()}
            times["time_step"] = time.perf_counter() - step_start  # everything but this write
            run.sink.write([{**row, **times} for row in rows])
    prefetcher.shutdown()
    run.sink.close()
    summary = _summary(cfg, history, run.run_dir, slots)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def start_run(cfg: CohortConfig) -> CohortRun:
    """Load data and members, build slots (engines, renderers), and restore the newest checkpoint if resuming."""
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    reward_spec = resolve_reward(cfg.reward)
    examples = load_training_examples(cfg.data.train)
    if cfg.data.paraphrases:  # a cache from `python -m data_tools.paraphrase`, aligned by example id
        examples, report = apply_paraphrases(examples, read_cache(cfg.data.paraphrases))
        log.info("paraphrases: %s", report.summary())
    sampler = LockstepSampler(len(examples), cfg.data.batch_size, cfg.data.seed, cfg.data.shuffle)
    resume_from = _resume_point(cfg, run_dir)
    members = [load_member(m, resume_from / m.id if resume_from else None) for m in cfg.members]
    for m in members:
        if m.cfg.trainable:
            # one optimizer step per pass over a rollout batch: the schedule spans all of them
            m.setup_optimizer(cfg.train, cfg.train.max_steps * cfg.algo.updates_per_batch)
            if resume_from:
                m.load_trainer_state(resume_from / m.id)
            if cfg.algo.kl_beta > 0:  # the KL anchor is the member's initial model, also after a resume
                m.reference = load_member(replace(m.cfg, trainable=False)).model.eval()
    max_images = max(len(ex.images) for ex in examples)
    slots = build_slots(cfg, members, reward_spec.layout, max_images, resume_from)
    lacking = check_views(examples, slots, cfg.data.view_fallback)
    if lacking:
        log.warning("examples without a slot's view, rendered in the original wording: %s", lacking)
    sink = MetricsSink(run_dir, cfg.logging.tensorboard)
    start, history = 0, []
    if resume_from:
        state = load_cohort_state(resume_from)
        start = state["step"]
        sampler.load_state_dict(state["sampler"])
        set_rng_states(state["rng"])
        history = sink.truncate_after(start)
        log.info("resumed from %s (step %d)", resume_from, start)
    return CohortRun(cfg, run_dir, examples, sampler, members, slots, sink, reward_spec, start, history)


def rollout_phase(cfg, slots: list[Slot], prompts, step: int) -> tuple[list, list[float]]:
    """Each slot samples K responses per prompt; returns its groups and its rollout seconds."""
    groups, seconds = [], []
    for i, (s, slot_prompts) in enumerate(zip(slots, prompts)):
        t0 = time.perf_counter()
        groups.append(s.engine.generate(slot_prompts, sampling_params(cfg, i, s.member.cfg.seed, step)))
        seconds.append(time.perf_counter() - t0)
    return groups, seconds


def extract_phase(cfg, slots: list[Slot], groups, batch) -> tuple[list, list]:
    """(N, B, K) extracted answers and format flags, each slot read in its member's prompt style."""
    style = cfg.reward.answer_style
    answers = [[[extract_answer(r.text, s.member.prompt_style if style == "auto" else style, ex.choices)
                 for r in g.responses] for g, ex in zip(gs, batch)] for gs, s in zip(groups, slots)]
    formats = [[[format_ok(r.text, s.member.prompt_style) for r in g.responses] for g in gs]
               for gs, s in zip(groups, slots)]
    return answers, formats


def update_phase(cfg, members, slots: list[Slot], groups, advantages, rewards, const_norm: int, step: int) -> dict:
    """Each trainable member takes one optimizer step on the sequences of all its slots; engines re-sync.

    An EMA teacher (co_rewarding_2) then moves toward its student. Returns {member id: update stats}.
    """
    updates = {}
    for m in members:
        mine = [n for n, s in enumerate(slots) if s.member is m]
        if not m.cfg.trainable:
            continue
        seqs = [seq for n in mine for seq in _sequences(groups[n], advantages[n], rewards[n], cfg)]
        if not seqs:
            updates[m.id] = {"trained_seqs": 0}
            continue
        updates[m.id] = policy_update(m, seqs, cfg.algo, cfg.train, cfg.rollout.temperature, const_norm)
        slots[mine[0]].engine.sync_weights()  # the next rollout samples from the updated policy
    decay = teacher_decay(step, cfg.train.max_steps, cfg.reward.teacher_decay_start, cfg.reward.teacher_decay_end)
    for s in slots:
        if s.follows is not None:  # an EMA teacher (co_rewarding_2)
            ema_update(s.member.model, s.follows.model, decay)
            s.engine.sync_weights()
    return updates


def _sequences(groups, advantages: torch.Tensor, rewards: torch.Tensor, cfg) -> list[Sequence]:
    """One slot's training sequences (zero-variance groups dropped when algo.filter_zero_variance)."""
    keep = nonzero_variance_groups(rewards) if cfg.algo.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
    return [Sequence(g.prompt.inputs, r.token_ids, float(advantages[j, k]))
            for j, g in enumerate(groups) if keep[j] for k, r in enumerate(g.responses)]


def intrinsic_scores(cfg, slots: list[Slot], groups) -> dict[str, torch.Tensor]:
    """(N, B, K) per-response mean entropy and self-certainty: from the rollout where the engine recorded them
    (HF), else from one batched scoring pass per slot (vLLM returns only top-k log-probs)."""
    per_slot = []
    for s, gs in zip(slots, groups):
        responses = [r for g in gs for r in g.responses]
        if all(r.entropy_sum is not None for r in responses):
            stats = {k: torch.tensor([r.mean(k) for r in responses]) for k in ("entropy", "self_certainty")}
        else:
            m = s.member
            stats = response_token_stats(m.model, [g.prompt.inputs for g in gs for _ in g.responses],
                                         [r.token_ids for r in responses], m.tokenizer.pad_token_id,
                                         cfg.rollout.temperature, m.mrope, m.suppressed_ids)
        per_slot.append({k: v.view(len(gs), -1) for k, v in stats.items()})
    return {k: torch.stack([p[k] for p in per_slot]).float() for k in ("entropy", "self_certainty")}


def load_training_examples(spec) -> list:
    """The training examples of a `DatasetConfig`: `skip` first ones dropped, then at most `limit`."""
    stop = spec.skip + spec.limit if spec.limit else None
    data = load_examples(spec.loader, spec.path, split=spec.split, limit=stop, **spec.options)
    log.info("data: %s", data.report.summary())
    return data.examples[spec.skip :]


def evaluate_cohort(members, eval_cfg, step: int) -> list[dict]:
    """The eval hook: every member on every configured benchmark (one row per member and benchmark)."""
    rows = []
    for name in eval_cfg.benchmarks:
        bench = BENCHMARKS.get(name)
        if eval_cfg.max_new_tokens:
            bench = replace(bench, max_new_tokens=eval_cfg.max_new_tokens)
        bench = replace(bench, temperature=eval_cfg.temperature)
        examples = benchmark_examples(bench, eval_cfg.limit)
        for m in members:
            result = evaluate_member(m, examples, bench)
            rows.append({"step": step, "member": m.id, "benchmark": name, "accuracy": result["accuracy"],
                         "n": result["n"], **{f"accuracy_{t}": a for t, a in result["by_type"].items()}})
    return rows


def _resume_point(cfg: CohortConfig, run_dir: Path) -> Path | None:
    if cfg.train.resume is False:
        return None
    found = latest_checkpoint(run_dir)
    if found is None and cfg.train.resume is True:
        raise FileNotFoundError(
            f"train.resume=true but {run_dir}/checkpoints holds no complete checkpoint: "
            "use train.resume=auto to start fresh when there is none"
        )
    return found


def _rows(step, slots, groups, cohort, scored, gold, updates, rollout_s, history=(), vote_threshold=0.0) -> list[dict]:
    """One metrics row per slot (per member, in the usual layout); update stats on the member's first slot.

    Cohort-level diagnostics (unanimity) are the same in every row; the collapse detector runs on `history`
    (the earlier rows) plus these rows, sets `collapse_flag` and logs a slot's first detection (vlm_corl.collapse).
    """
    rows, reported = [], set()
    shared = cohort_metrics(cohort, gold, vote_threshold)
    for n, s in enumerate(slots):
        lengths = [[len(r.token_ids) for r in g.responses] for g in groups[n]]
        row = {"step": step, "member": s.id}
        row.update(member_metrics(n, cohort, scored, lengths, gold))
        row.update(shared)
        stats = updates.get(s.member.id, {}) if s.member.id not in reported else {}
        reported.add(s.member.id)
        row.update({k: stats.get(k) for k in ("loss", "grad_norm", "lr")})
        row["tokens_per_s"] = sum(map(sum, lengths)) / rollout_s[n]
        rows.append(row)
    flag_step(history, rows)
    return rows


def _summary(cfg, history: list[dict], run_dir: Path, slots) -> dict:
    last = {}
    for row in history:
        last[row["member"]] = row
    return {
        "run_dir": str(run_dir),
        "steps": cfg.train.max_steps,
        "reward_mode": cfg.reward.custom or cfg.reward.mode,
        "members": {mid: {k: row.get(k) for k in ("reward_mean", "agreement", "pseudo_label_acc", "answer_acc")}
                    for mid, row in last.items()},
        "view_fallbacks": {s.id: s.renderer.view_fallbacks for s in slots},
        # each slot's first detection of "diversity falls while agreement rises" (vlm_corl.collapse)
        "collapse_warnings": collapse_warnings(history),
        "checkpoint": str(latest_checkpoint(run_dir)) if latest_checkpoint(run_dir) else None,
    }

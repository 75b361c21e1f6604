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
from vlm_corl.config import CohortConfig, save_config
from vlm_corl.eval import benchmark_examples, evaluate_member
from vlm_corl.data import load_examples
from vlm_corl.exchange import exchange
from vlm_corl.grpo import group_advantages, nonzero_variance_groups
from vlm_corl.member import load_member
from vlm_corl.metrics import MetricsSink, member_metrics
from vlm_corl.registry import BENCHMARKS
from vlm_corl.render import Renderer
from vlm_corl.rewards import CohortBatch, resolve_reward
from vlm_corl.rollout import SamplingParams, make_engine
from vlm_corl.sampler import LockstepSampler
from vlm_corl.update import Sequence, policy_update

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
    """Everything a run holds between steps: data order, members with their engines and renderers, sinks."""

    cfg: CohortConfig
    run_dir: Path
    examples: list
    sampler: LockstepSampler
    members: list
    engines: list
    renderers: list
    sink: MetricsSink
    reward_spec: object
    start: int


def run_cohort(cfg: CohortConfig) -> dict:
    """Train the cohort described by `cfg`; returns the summary also written to summary.json."""
    run = start_run(cfg)
    members, engines = run.members, run.engines
    const_norm = cfg.algo.drgrpo_norm or cfg.rollout.max_new_tokens
    bar = tqdm(range(run.start, cfg.train.max_steps), initial=run.start, total=cfg.train.max_steps,
               disable=not cfg.logging.progress, desc="cohort", dynamic_ncols=True)
    history: list[dict] = []
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
            prompts = [[render(ex) for ex in batch] for render in run.renderers]
            if step + 1 < cfg.train.max_steps:
                upcoming = [run.examples[i] for i in run.sampler.peek_batch()]
                prefetch = prefetcher.submit(lambda exs=upcoming: [render(ex) for render in run.renderers for ex in exs])
        with timer("rollout"):
            groups, rollout_s = rollout_phase(cfg, engines, members, prompts, step)
        with timer("extract"):
            answers, formats = extract_phase(cfg, members, groups, batch)
        with timer("exchange"):
            local = {m.id: {g.prompt.example_id: (a, f, [r.text for r in g.responses]) for g, a, f in zip(gs, ans, fmt)}
                     for m, gs, ans, fmt in zip(members, groups, answers, formats)}
            answers, formats, texts = exchange([ex.id for ex in batch], local, [m.id for m in members])
        with timer("reward"):
            gold = [ex.answer for ex in batch]
            cohort = CohortBatch(
                member_ids=tuple(m.id for m in members), answers=answers, format_ok=formats, texts=texts,
                choices=[ex.choices for ex in batch],
                gold=gold if run.reward_spec.uses_gold else [None] * len(batch),  # labels reach `gt` only
                scores=_intrinsic_scores(groups),
            )
            scored = run.reward_spec.fn(cohort, cfg.reward)
        with timer("advantage"):
            advantages = [group_advantages(scored.rewards[n], cfg.algo.scale_rewards, cfg.algo.adv_eps)
                          for n in range(len(members))]
        with timer("update"):
            updates = [_update(m, gs, adv, scored.rewards[n], cfg, const_norm)
                       for n, (m, gs, adv) in enumerate(zip(members, groups, advantages))]
            for eng, upd in zip(engines, updates):
                if "loss" in upd:  # an optimizer step ran (Adam moves weights even on zero gradients)
                    eng.sync_weights()  # the next rollout samples from the updated policy
        with timer("log"):
            rows = _rows(step + 1, members, groups, cohort, scored, gold, updates, rollout_s)
            history.extend(rows)
            bar.set_postfix(reward=" ".join(f"{r['reward_mean']:.2f}" for r in rows))
        if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0 or step + 1 == cfg.train.max_steps:
            with timer("checkpoint"):
                save_checkpoint(run.run_dir, step + 1, members, {"sampler": run.sampler.state_dict()},
                                cfg.train.keep_last)
        if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
            with timer("eval"):
                run.sink.write_eval(evaluate_cohort(members, cfg.eval, step + 1))
        if (step + 1) % cfg.logging.log_every == 0:
            times = {f"time_{k}": v for k, v in timer.seconds.items()}
            times["time_step"] = time.perf_counter() - step_start  # everything but this write
            run.sink.write([{**row, **times} for row in rows])
    prefetcher.shutdown()
    run.sink.close()
    summary = _summary(cfg, history, run.run_dir, run.renderers)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def start_run(cfg: CohortConfig) -> CohortRun:
    """Load data and members, build engines and renderers, and restore the newest checkpoint if resuming."""
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    examples = load_training_examples(cfg.data.train)
    sampler = LockstepSampler(len(examples), cfg.data.batch_size, cfg.data.seed, cfg.data.shuffle)
    resume_from = _resume_point(cfg, run_dir)
    members = [load_member(m, resume_from / m.id if resume_from else None) for m in cfg.members]
    for m in members:
        if m.cfg.trainable:
            m.setup_optimizer(cfg.train, cfg.train.max_steps)
            if resume_from:
                m.load_trainer_state(resume_from / m.id)
            if cfg.algo.kl_beta > 0:  # the KL anchor is the member's initial model, also after a resume
                m.reference = load_member(replace(m.cfg, trainable=False)).model.eval()
    max_images = max(len(ex.images) for ex in examples)
    engines = [make_engine(cfg.rollout.engine, m, cfg.rollout, max_images) for m in members]
    renderers = [Renderer(m, cfg.data.view_fallback, cfg.data.max_image_pixels, cfg.rollout.max_prompt_tokens)
                 for m in members]
    sink = MetricsSink(run_dir, cfg.logging.tensorboard)
    start = 0
    if resume_from:
        state = load_cohort_state(resume_from)
        start = state["step"]
        sampler.load_state_dict(state["sampler"])
        set_rng_states(state["rng"])
        sink.truncate_after(start)
        log.info("resumed from %s (step %d)", resume_from, start)
    return CohortRun(cfg, run_dir, examples, sampler, members, engines, renderers, sink, resolve_reward(cfg.reward),
                     start)


def rollout_phase(cfg, engines, members, prompts, step: int) -> tuple[list, list[float]]:
    """Each member samples K responses per prompt; returns its groups and its rollout seconds."""
    groups, seconds = [], []
    for i, (engine, member_prompts, m) in enumerate(zip(engines, prompts, members)):
        t0 = time.perf_counter()
        groups.append(engine.generate(member_prompts, sampling_params(cfg, i, m.cfg.seed, step)))
        seconds.append(time.perf_counter() - t0)
    return groups, seconds


def extract_phase(cfg, members, groups, batch) -> tuple[list, list]:
    """(N, B, K) extracted answers and format flags, each member read in its own prompt style."""
    style = cfg.reward.answer_style
    answers = [[[extract_answer(r.text, m.prompt_style if style == "auto" else style, ex.choices)
                 for r in g.responses] for g, ex in zip(gs, batch)] for gs, m in zip(groups, members)]
    formats = [[[format_ok(r.text, m.prompt_style) for r in g.responses] for g in gs]
               for gs, m in zip(groups, members)]
    return answers, formats


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


def _intrinsic_scores(groups) -> dict[str, torch.Tensor]:
    """(N, B, K) per-token means of the rollout's sampling statistics (for intrinsic-reward baselines)."""
    out = {}
    for stat in ("entropy", "self_certainty"):
        values = [[[r.mean(stat) for r in g.responses] for g in gs] for gs in groups]
        if all(v is not None for member in values for group in member for v in group):
            out[stat] = torch.tensor(values, dtype=torch.float32)
    return out


def _update(member, groups, advantages: torch.Tensor, rewards: torch.Tensor, cfg, const_norm: int) -> dict:
    """Build the member's training sequences and run its update (frozen members only report)."""
    if not member.cfg.trainable:
        return {}
    keep = nonzero_variance_groups(rewards) if cfg.algo.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
    seqs = [
        Sequence(g.prompt.inputs, r.token_ids, float(advantages[j, k]))
        for j, g in enumerate(groups) if keep[j]
        for k, r in enumerate(g.responses)
    ]
    if not seqs:
        return {"trained_seqs": 0}
    return policy_update(member, seqs, cfg.algo, cfg.train, cfg.rollout.temperature, const_norm)


def _rows(step, members, groups, cohort, scored, gold, updates, rollout_s) -> list[dict]:
    rows = []
    for n, m in enumerate(members):
        lengths = [[len(r.token_ids) for r in g.responses] for g in groups[n]]
        row = {"step": step, "member": m.id}
        row.update(member_metrics(n, cohort, scored, lengths, gold))
        row.update({k: updates[n].get(k) for k in ("loss", "grad_norm", "lr")})
        row["tokens_per_s"] = sum(map(sum, lengths)) / rollout_s[n]
        rows.append(row)
    return rows


def _summary(cfg, history: list[dict], run_dir: Path, renderers) -> dict:
    last = {}
    for row in history:
        last[row["member"]] = row
    return {
        "run_dir": str(run_dir),
        "steps": cfg.train.max_steps,
        "reward_mode": cfg.reward.custom or cfg.reward.mode,
        "members": {mid: {k: row.get(k) for k in ("reward_mean", "agreement", "pseudo_label_acc", "answer_acc")}
                    for mid, row in last.items()},
        "view_fallbacks": {r.member.id: r.view_fallbacks for r in renderers},
        "checkpoint": str(latest_checkpoint(run_dir)) if latest_checkpoint(run_dir) else None,
    }

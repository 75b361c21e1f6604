"""The rollout and extract phases: each hosted slot samples K responses per prompt of its shard with seeds that
are a pure function of (run, slot, step, batch position), and its answers, format flags, lengths and intrinsic
scores are read out for the exchange."""

from __future__ import annotations

import time

import torch

from vlm_corl.config import CohortConfig
from vlm_corl.data.answers import extract_answer
from vlm_corl.data.records import Example
from vlm_corl.members.rollout import Prompt, RolloutGroup, SamplingParams
from vlm_corl.members.update import response_token_stats
from vlm_corl.training.run.setup import CohortRun
from vlm_corl.training.run.slots import owner

FORMAT_PATTERNS = {"boxed": "\\boxed{", "answer_tags": "<answer>"}


def sampling_params(
    cfg: CohortConfig, slot_index: int, member_seed: int, step: int, first_position: int = 0, resample_round: int = 0
) -> SamplingParams:
    """A slot's sampling parameters at `step` for prompts from batch position `first_position` on; its seed
    is a pure function of (run, slot, step), so a resumed run samples exactly what the uninterrupted one
    would have (engines derive each prompt's stream from the seed and the prompt's batch position). A round of
    dynamic sampling (`resample_round` >= 1) has seeds of its own, its prompts' positions those of its questions."""
    r = cfg.rollout
    seed = (cfg.seed * 1_000_003 + (slot_index * 7919 + member_seed) * 104_729 + step + (resample_round << 32)) % (
        2**63
    )
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=tuple(r.stop),
        seed=seed,
        first_position=first_position,
    )


def format_ok(text: str, style: str) -> bool:
    """Does a response use the member's answer format (a format reward's input)?"""
    return FORMAT_PATTERNS[style] in text


def rollout_phase(
    run: CohortRun,
    prompts: list[list[Prompt]],
    step: int,
    shards: dict[str, range] | None = None,
    resample_round: int = 0,
) -> tuple[list, dict[str, float]]:
    """Each hosted slot samples K responses per prompt of its shard; returns its groups and rollout seconds.

    Samples are a pure function of (run seed, slot, step, batch position, k), so splitting the batch over
    more ranks draws the same responses. A round of dynamic sampling gives its questions' `shards` and its
    `resample_round` (its own seeds); a slot with no question there samples nothing."""
    groups, seconds = [], {}
    for s, slot_prompts in zip(run.slots, prompts):
        t0 = time.perf_counter()
        if shards is None:
            params = sampling_params(run.cfg, s.index, s.member.cfg.seed, step, run.shards[owner(s)].start)
        else:
            start = shards[owner(s)].start
            params = sampling_params(run.cfg, s.index, s.member.cfg.seed, step, start, resample_round)
        groups.append(s.engine.generate(slot_prompts, params) if slot_prompts else [])
        seconds[s.id] = time.perf_counter() - t0
    return groups, seconds


def extract_phase(
    run: CohortRun, groups: list[list[RolloutGroup]], batch: list[Example], shards: dict[str, range] | None = None
) -> dict[str, dict[int, tuple]]:
    """This process's rows for the exchange: {slot id: {batch position: (answers, format flags, texts,
    lengths, mean entropies, mean self-certainties, truncated)}}, K each; answers read in the member's prompt
    style; truncated: the response hit rollout.max_new_tokens without an end (the engine's finish_reason
    "length"). `shards`: the positions of a round of dynamic sampling."""
    shards = run.shards if shards is None else shards
    style = run.cfg.reward.answer_style
    scores = intrinsic_scores(run, groups) if run.reward_spec.needs_scores else None
    local = {}
    for n, (s, gs) in enumerate(zip(run.slots, groups)):
        read = s.member.prompt_style if style == "auto" else style
        rows = {}
        for j, (p, g) in enumerate(zip(shards[owner(s)], gs)):
            k = len(g.responses)
            rows[p] = (
                [extract_answer(r.text, read, batch[p].choices) for r in g.responses],
                [format_ok(r.text, s.member.prompt_style) for r in g.responses],
                [r.text for r in g.responses],
                [len(r.token_ids) for r in g.responses],
                scores[n]["entropy"][j].tolist() if scores else [0.0] * k,
                scores[n]["self_certainty"][j].tolist() if scores else [0.0] * k,
                [r.finish_reason == "length" for r in g.responses],
            )
        local[s.id] = rows
    return local


def intrinsic_scores(run: CohortRun, groups: list[list[RolloutGroup]]) -> list[dict[str, torch.Tensor]]:
    """Per hosted slot, (G, K) per-response mean entropy and self-certainty of its shard: from the rollout
    where the engine recorded them (HF), else from one batched scoring pass (vLLM returns only top-k log-probs)."""
    per_slot = []
    for s, gs in zip(run.slots, groups):
        responses = [r for g in gs for r in g.responses]
        if not responses and not s.member.partitioned:  # no question of a resampling round on this rank
            per_slot.append({})
            continue
        if not responses:  # its ranks' scoring passes are collectives: this rank would have none to run
            raise NotImplementedError(
                f"member {s.member.id!r} (ZeRO-3, partitioned) has no question of this round of dynamic sampling "
                "on this rank to score for the intrinsic reward: algo.resample_zero_variance does not support "
                "this layout yet; turn it off or place the member on one rank"
            )
        if all(r.entropy_sum is not None for r in responses):
            stats = {k: torch.tensor([r.mean(k) for r in responses]) for k in ("entropy", "self_certainty")}
        else:
            m, size = s.member, run.cfg.train.micro_batch_size
            # A partitioned ZeRO-3 member scores through its engine: its ranks run as many passes (fillers).
            passes = m.micro_batch_count(-(-len(responses) // size)) if m.partitioned else None
            with m.autocast(), m.updating():
                stats = response_token_stats(
                    m.scoring_module,
                    [g.prompt.inputs for g in gs for _ in g.responses],
                    [r.token_ids for r in responses],
                    m.policy(run.cfg.rollout.temperature),
                    micro_batch_size=size,
                    passes=passes,
                )
        per_slot.append({k: v.float().cpu().view(len(gs), -1) for k, v in stats.items()})
    return per_slot

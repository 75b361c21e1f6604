"""Rollouts on the member's own Hugging Face module (any machine): K sampled responses per prompt.

Each prompt (and its images) goes through the model once; its KV cache is repeated K times and the K samples
are decoded from it by a short loop over the model's forward pass (`batching.prefill` / `continuation`), not by
`generate`, which would prefill and encode every prompt K times and pay its per-token machinery. Greedy
decoding emits exactly `generate`'s tokens (tests/test_rollout.py checks every family of the zoo). With
the engine's `static_cache` (auto: on CUDA) the one-token steps run over a static KV cache with fixed shapes,
captured as CUDA graphs on a GPU (`vlm_corl.members.static_decode`): the same tokens and log-probs.

Sampling follows `generate(do_sample=True)` with `suppress_tokens`, temperature, top-k and top-p. The policy
is the tempered distribution with the member's suppressed (control) tokens removed, the one the update's
log-probs use; Hugging Face's top-k / top-p warpers then restrict what is drawn from it, one token per row
per step. The draw (`draw`) has `torch.multinomial`'s distribution but another random stream, so a seed gives
other samples than `generate` would. The per-token statistics (sampled token's log-prob, entropy,
self-certainty) describe the policy, before top-k/top-p. A row stops at any end-of-sequence token (kept in
the response) or at a stop string that ends in its last token, as `generate`'s stop criteria do; temperature
0 is greedy decoding. Other knobs a checkpoint's generation_config may carry (repetition penalty, ...) are
not applied: the update could not reproduce them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import StopStringCriteria

from vlm_corl.members.batching import prefill
from vlm_corl.members.finite import NonFiniteLogits
from vlm_corl.members.rollout import Policy, Prompt, Response, RolloutGroup, SamplingParams
from vlm_corl.members.static_decode import StaticBuckets, decode_steps

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HFEngine:
    """Rollout engine over the forward pass of a loaded member (see `vlm_corl.members.member.Member`);
    `static_cache`: auto (on CUDA) | on | off (rollout.hf_static_cache)."""

    def __init__(self, member, static_cache: str = "auto"):
        self.member, self.static_cache = member, static_cache
        self.buckets = StaticBuckets()  # the static cache and captured step, kept from one rollout to the next

    def sync_weights(self) -> None:
        """Sampling uses the member's live module; an EMA teacher's rollout-dtype copy takes its new weights."""
        self.member.refresh_rollout_copy()

    def sleep(self) -> None:
        """The static cache (`buckets`) freed for the update, as the memory plan has it (the weights are the
        member's); its compiled step stays, so the next rollout of its shape only records its graph again."""
        self.buckets.clear()

    def wake(self) -> None:
        """Nothing to take back."""

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[RolloutGroup]:
        member = self.member
        tok = member.tokenizer
        model = member.generation_module
        was_training = model.training
        model.eval()
        # bf16 compute over fp32 masters on a GPU (member.rollout_dtype); the recorded statistics stay fp32.
        # no_grad, not inference_mode: autocast caches its weight casts only outside inference mode, so each
        # weight is cast once per rollout instead of once per decoded token (bench/rollout_precision.py).
        with member.rollout_autocast(), torch.no_grad():
            try:
                tokens, stopped, sums, token_logp = sample(
                    model, [p.inputs for p in prompts], params, member.policy(params.temperature),
                    Endings(member.eos_token_ids, tok), Decoding(self.static_cache, self.buckets),
                )  # fmt: skip
            except NonFiniteLogits as err:
                raise NonFiniteLogits(f"member {member.id!r}: {err}") from None
        model.train(was_training)
        groups = []
        for i, prompt in enumerate(prompts):
            group = RolloutGroup(prompt)
            for j in range(i * params.n, (i + 1) * params.n):
                group.responses.append(
                    Response(
                        token_ids=tokens[j],
                        text=tok.decode(tokens[j], skip_special_tokens=True),
                        finish_reason="stop" if stopped[j] else "length",
                        logprob_sum=sums["logprob"][j],
                        entropy_sum=sums["entropy"][j],
                        self_certainty_sum=sums["self_certainty"][j],
                        token_logprobs=token_logp[j],
                    )
                )
            groups.append(group)
        return groups


@dataclass(frozen=True)
class Endings:
    """What ends a response besides the length limit: the member's end-of-sequence ids, and its tokenizer, which
    `StopStrings` reads to find the stop strings of `SamplingParams.stop` in the tokens."""

    eos_ids: list[int]
    tokenizer: PreTrainedTokenizerBase


@dataclass(frozen=True)
class Decoding:
    """How `sample` runs its one-token steps, which changes no token: `static_cache` (auto | on | off) chooses the
    steps (`static_decode.decode_steps`), over the static cache of `buckets` (an engine's, kept across rollouts
    until it sleeps; a fresh one when None)."""

    static_cache: str = "auto"
    buckets: StaticBuckets | None = None


def sample(
    model: torch.nn.Module,
    prompt_inputs: list[dict],
    params: SamplingParams,
    policy: Policy,
    endings: Endings,
    decoding: Decoding | None = None,
) -> tuple[list[list[int]], list[bool], dict, list]:
    """Decode params.n responses per prompt; rows i*n .. i*n+n-1 belong to prompt i, from `policy` (its pad id,
    suppressed tokens, M-RoPE flag; the temperature and the rest of the draw come from `params`), ended by
    `endings`, with the decoding steps of `decoding` (default: `Decoding()`).

    Returns per row: its tokens (up to and including the eos or the token that completes a stop string),
    whether it stopped (eos or stop string, not the length limit), the sums over its tokens of the
    policy's statistics {"logprob": [...], "entropy": [...], "self_certainty": [...]}, and the policy's
    log-prob of each of its tokens.
    """
    decoding = decoding or Decoding()
    prefix = prefill(model, [p for p in prompt_inputs for _ in range(params.n)], policy.pad_id, policy.mrope)
    logits, limit = prefix.last_logits, params.max_new_tokens
    (rows, vocab), device = logits.shape, logits.device
    steps = decode_steps(model, prefix, limit, decoding.static_cache, policy.pad_id, decoding.buckets)
    del prefix  # over a static cache the prompts' keys and values are the bucket's now: the prefix's cache goes
    uniforms = row_uniforms(params, rows).to(device)  # (R, T): row r's draw at step t
    choose, eos = Chooser(params), torch.tensor(endings.eos_ids, device=device)
    samplable = _samplable(vocab, policy.suppressed, device)  # (V',) token ids the policy can emit
    stops = StopStrings(endings.tokenizer, params.stop) if params.stop else None
    tokens, stats, lengths = _row_buffers(rows, limit, policy.pad_id, device)
    # The batch (indices into the R rows) and which of its rows still decode. A row that ends stays in the batch
    # until the next synchronisation (`sync_every`), where ended rows leave the batch and the cache (over a
    # static cache they stay to the end, fed the pad token: `steps.keeps_rows`); between two, the loop reads
    # nothing back from the device (on a GPU each read waits for every queued kernel).
    # Finite logits are checked once, at the end. `at` indexes the batch's rows in the (R, ...) tensors: a plain
    # slice while every row decodes (a strided copy per write, not an indexed scatter).
    active, at = torch.arange(rows, device=device), slice(None)
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    every, synced = sync_every(device), 0
    for t in range(limit):
        next_tokens, chosen = _choose_tokens(logits, samplable, params, choose, uniforms[at, t])
        for name, value in chosen.items():
            stats[name][at, t] = value
        tokens[at, t] = next_tokens
        ended = alive & torch.isin(next_tokens, eos)
        lengths[at] = torch.where(ended, t + 1, lengths[at])
        alive &= ~ended
        if t + 1 < limit and (t + 1 - synced) % every:
            logits = steps.logits(next_tokens, alive, t)
            continue
        # a synchronisation: stop strings in the tokens since the last one, who is left
        if stops is not None:
            alive &= stops.cut(tokens, active, lengths, synced, t)
        synced = t + 1
        left = 0 if t + 1 == limit else int(alive.sum())  # one read from the device per synchronisation
        if not left:
            break
        if not steps.keeps_rows and left < len(alive):
            active, alive, next_tokens = _drop_ended(steps, active, alive, next_tokens, left)
            at = active
        logits = steps.logits(next_tokens, alive, t)
    return _results(tokens, stats, lengths, endings.eos_ids, stops)


def _row_buffers(rows: int, limit: int, pad_id: int, device) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """What `sample` writes per row: its tokens (pad past its end), the policy's statistics of each token (summed at
    the end), and its length: the length limit until it ends (an eos token, or a stop string found at a sync
    point)."""
    tokens = torch.full((rows, limit), pad_id, dtype=torch.long, device=device)
    stats = {name: torch.zeros(rows, limit, device=device) for name in STATS}
    lengths = torch.full((rows,), limit, dtype=torch.long, device=device)
    return tokens, stats, lengths


def _choose_tokens(
    logits: torch.Tensor, samplable: torch.Tensor, params: SamplingParams, choose: Chooser, u: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step's draw: the active rows' next tokens (A,) and the policy's statistics of them."""
    scores, logp = _policy_scores(logits, samplable, params, choose.greedy)
    probs = logp.exp()
    choice = choose(scores, probs, u).clamp_(max=len(samplable) - 1)  # NaN: in range
    return samplable[choice], _chosen_token_stats(logp, probs, choice)


def _drop_ended(
    steps, active: torch.Tensor, alive: torch.Tensor, next_tokens: torch.Tensor, left: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch without its ended rows (`left` of them still decode), which leave the decoding steps' cache too
    (no work for them)."""
    keep = alive.nonzero_static(size=left).squeeze(1)  # `left` known: no second read of the device
    steps.select(keep)
    return active[keep], alive[keep], next_tokens[keep]


def _results(
    tokens: torch.Tensor, stats: dict, lengths: torch.Tensor, eos_ids: list[int], stops: StopStrings | None
) -> tuple[list[list[int]], list[bool], dict, list]:
    """`sample`'s answer from its row buffers, once the logits at every row's own tokens are found finite."""
    limit = tokens.shape[1]
    within = torch.arange(limit, device=tokens.device) < lengths[:, None]  # (R, T): each row's own tokens
    _check_finite(stats["entropy"], within)
    sums = {name: (value * within).sum(dim=1).tolist() for name, value in stats.items()}
    n_tokens = lengths.tolist()
    stopped = [n < limit or _ends(row, eos_ids, stops) for n, row in zip(n_tokens, tokens.tolist())]
    rows_tokens, rows_logp = (_cut(rows.tolist(), n_tokens) for rows in (tokens, stats["logprob"]))
    return rows_tokens, stopped, sums, rows_logp


STATS = ("logprob", "entropy", "self_certainty")  # the policy's statistics of each sampled token


def sync_every(device: torch.device) -> int:
    """Decode steps between reads from the device (has every row ended? a stop string?). On a CPU
    a read costs nothing, so every step (a batch ends as soon as its last row does); on a GPU each read waits
    for the queued kernels, so every 8 steps (a batch that has ended decodes at most 7 more tokens)."""
    return 1 if torch.device(device).type == "cpu" else 8


def _ends(row: list[int], eos_ids: list[int], stops: StopStrings | None) -> bool:
    """Whether a response that reached the length limit ended there anyway (its last token an eos, or the one
    completing a stop string): `generate` counts those as stopped."""
    return row[-1] in eos_ids or (stops is not None and stops.ends_in_last(row))


def _policy_scores(
    logits: torch.Tensor, samplable: torch.Tensor, params: SamplingParams, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The active rows' tempered scores (A, V') over the samplable tokens and the policy's log-probs of them."""
    scores = logits.index_select(1, samplable).float()  # (A, V'): suppressed tokens have probability 0
    if not greedy and params.temperature != 1.0:
        scores = scores / params.temperature
    return scores, torch.log_softmax(scores, dim=-1)  # the policy's log-probs


def _check_finite(entropy: torch.Tensor, within: torch.Tensor) -> None:
    """Raise NonFiniteLogits when a row's logits were not finite at one of its own tokens (`within`).

    One NaN or infinite logit makes that token's entropy NaN (-p log p over the softmax: NaN everywhere for NaN
    or +inf, 0 x -inf for -inf), so (R, T) numbers are checked once per rollout instead of (R, V) logits per
    token. A token sampled meanwhile from NaN is clamped into the vocabulary, and the rollout is refused here."""
    # one read: a boolean-mask index would be a second (its size depends on the data)
    if not bool((torch.isfinite(entropy) | ~within).all()):
        raise NonFiniteLogits(
            "its forward pass gave non-finite logits (its weights or activations hold NaN or infinity: a diverged "
            "model, or an overflow in its compute dtype)"
        )


def _cut(rows: list[list], lengths: list[int]) -> list[list]:
    """Each row's first `lengths[i]` entries (the rest is padding past its end)."""
    return [row[:n] for row, n in zip(rows, lengths)]


def _samplable(vocab: int, suppressed, device) -> torch.Tensor:
    """The token ids (ascending) a policy with these suppressed ids can emit."""
    mask = torch.ones(vocab, dtype=torch.bool, device=device)
    mask[list(suppressed)] = False
    return mask.nonzero().squeeze(1)


def _chosen_token_stats(logp: torch.Tensor, probs: torch.Tensor, choice: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: the log-prob of the chosen token, and the entropy and self-certainty of the distribution
    (token_entropy / token_self_certainty of training/rewards/grpo.py), from one log-softmax over the V' tokens."""
    return {
        "logprob": logp.gather(-1, choice[:, None]).squeeze(-1),
        "entropy": -(probs * logp).sum(dim=-1),
        "self_certainty": -logp.mean(dim=-1) - math.log(logp.shape[-1]),
    }


class Chooser:
    """How one token per row is picked from the policy: argmax at temperature 0, else a draw from the policy
    restricted by Hugging Face's top-k / top-p warpers (when set), one uniform number per row."""

    def __init__(self, params: SamplingParams):
        self.greedy = params.temperature == 0
        self.warpers = (
            []
            if self.greedy
            else (
                ([TopKLogitsWarper(params.top_k)] if params.top_k > 0 else [])
                + ([TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else [])
            )
        )

    def __call__(self, scores: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """(A,) chosen indices into the samplable tokens; scores (A, V') tempered logits, probs their softmax."""
        if self.greedy:
            return scores.argmax(dim=-1)
        if self.warpers:
            for warp in self.warpers:
                scores = warp(None, scores)
            probs = torch.softmax(scores, dim=-1)
        return draw(probs, u)


def row_uniforms(params: SamplingParams, rows: int) -> torch.Tensor:
    """(rows, max_new_tokens) float64 uniforms in [0, 1): row i's stream is seeded by the step's seed and the
    row's place in the whole batch ((first_position + prompt) * n + k), so a prompt draws the same samples
    whichever rank rolls it out and whatever else is in its call, and whatever ran before (no global RNG)."""
    first = params.first_position * params.n
    gen = torch.Generator()
    out = torch.empty(rows, params.max_new_tokens, dtype=torch.float64)
    for i in range(rows):
        gen.manual_seed((params.seed * 1_000_003 + first + i) % (2**63))
        out[i] = torch.rand(params.max_new_tokens, dtype=torch.float64, generator=gen)
    return out


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of (R, V) probabilities, by inverse CDF of one uniform number u (R,) per row.

    The same distribution as `torch.multinomial(probs, 1)`, which draws V exponentials per row (on CPU that
    alone was ~20% of a tiny model's rollout). A zero-probability token is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)  # (R, V)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1)


class StopStrings:
    """Where stop strings end responses: at the first token that completes one (the token is kept), as
    `generate` decides, by its own `StopStringCriteria`: tensor operations over each row's last tokens, run on
    the device (no token decoded, nothing read back), which match a stop string on the tokens' bytes, so a
    non-ASCII character split over byte-level tokens is found too (tests/test_stop_strings.py)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.criteria = _criteria(tokenizer, stop)
        # the criteria read at most this many tokens back (one per character, or per byte)
        self.window = self.criteria.maximum_token_len

    def first_hits(
        self, tokens: torch.Tensor, active: torch.Tensor, lengths: torch.Tensor, start: int, t: int
    ) -> torch.Tensor:
        """(A,) per batch row: 1 + the first step in start..t whose token completes a stop string, within the
        row's own tokens (before `lengths`); a large number where none does."""
        first = max(0, start - self.window + 1)
        span, own = tokens[active, first : t + 1], lengths[active]  # (A, S): the window before `start` too
        hits = torch.full_like(own, 1 << 30)
        for step in range(t, start - 1, -1):  # backwards: the first hit is written last
            ends = self.criteria(span[:, : step + 1 - first], None) & (step < own)
            hits = torch.where(ends, step + 1, hits)
        return hits

    def cut(
        self, tokens: torch.Tensor, active: torch.Tensor, lengths: torch.Tensor, start: int, t: int
    ) -> torch.Tensor:
        """Shorten each batch row's length (`lengths`, in place) to its first stop string in steps start..t; (A,)
        whether the row may still decode past step t."""
        stopped_at = self.first_hits(tokens, active, lengths, start, t)
        lengths[active] = torch.minimum(lengths[active], stopped_at)
        return stopped_at > t + 1

    def ends_in_last(self, row: list[int]) -> bool:
        """Whether the last token of `row` completes a stop string."""
        return bool(self.criteria(torch.tensor([row[-self.window :]]), None)[0])


@functools.lru_cache(maxsize=16)
def _criteria(tokenizer, stop: tuple[str, ...]) -> StopStringCriteria:
    """`generate`'s matcher of `stop`, built once per tokenizer and stop strings (it reads the whole vocabulary)."""
    return StopStringCriteria(tokenizer, list(stop))

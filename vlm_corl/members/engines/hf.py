"""Rollouts on the member's own Hugging Face module (any machine): K sampled responses per prompt.

Each prompt (and its images) goes through the model once; its KV cache is repeated K times and the K samples
are decoded from it by a short loop over the model's forward pass (`batching.prefill` / `continuation`), not by
`generate`, which would prefill and encode every prompt K times and pay its per-token machinery. Greedy
decoding emits exactly `generate`'s tokens (tests/test_rollout.py checks every family of the zoo).

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

import math
from typing import TYPE_CHECKING

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from vlm_corl.members.batching import continuation, prefill
from vlm_corl.members.finite import NonFiniteLogits
from vlm_corl.members.rollout import Policy, Prompt, Response, RolloutGroup, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class HFEngine:
    """Rollout engine over the forward pass of a loaded member (see `vlm_corl.members.member.Member`)."""

    def __init__(self, member):
        self.member = member

    def sync_weights(self) -> None:
        """Sampling uses the member's live module; an EMA teacher's rollout-dtype copy takes its new weights."""
        self.member.refresh_rollout_copy()

    def sleep(self) -> None:
        """Nothing to release: the engine holds no memory of its own."""

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
                    model, [p.inputs for p in prompts], params, member.policy(params.temperature), member.eos_token_ids,
                    tok,
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


def sample(
    model: torch.nn.Module,
    prompt_inputs: list[dict],
    params: SamplingParams,
    policy: Policy,
    eos_ids: list[int],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[list[list[int]], list[bool], dict, list]:
    """Decode params.n responses per prompt; rows i*n .. i*n+n-1 belong to prompt i, from `policy` (its pad id,
    suppressed tokens, M-RoPE flag; the temperature and the rest of the draw come from `params`).

    Returns per row: its tokens (up to and including the eos or the token that completes a stop string),
    whether it stopped (eos or stop string, not the length limit), the sums over its tokens of the
    policy's statistics {"logprob": [...], "entropy": [...], "self_certainty": [...]}, and the policy's
    log-prob of each of its tokens.
    """
    prefix = prefill(model, [p for p in prompt_inputs for _ in range(params.n)], policy.pad_id, policy.mrope)
    rows, vocab = prefix.last_logits.shape
    device = prefix.last_logits.device
    uniforms = row_uniforms(params, rows).to(device)  # (R, T): row r's draw at step t
    choose, eos = Chooser(params), torch.tensor(eos_ids, device=device)
    samplable = _samplable(vocab, policy.suppressed, device)  # (V',) token ids the policy can emit
    tokens = torch.full((rows, params.max_new_tokens), policy.pad_id, dtype=torch.long, device=device)
    stopped, lengths = (torch.zeros(rows, dtype=kind, device=device) for kind in (torch.bool, torch.long))
    sums = {name: torch.zeros(rows, device=device) for name in ("logprob", "entropy", "self_certainty")}
    token_logp = torch.zeros(rows, params.max_new_tokens, device=device)
    texts = [""] * rows  # decoded responses so far, only when stop strings are checked
    generated = torch.ones(rows, params.max_new_tokens, dtype=torch.long, device=device)  # sampled tokens' mask
    # Rows still decoding (indices into the R rows): a row that ends leaves the batch and the cache.
    active = torch.arange(rows, device=device)
    logits = prefix.last_logits
    for t in range(params.max_new_tokens):
        scores, logp = _policy_scores(logits, samplable, params, choose.greedy, t)
        probs = logp.exp()
        choice = choose(scores, probs, uniforms[active, t])
        next_tokens = samplable[choice]  # (A,)
        stats = _chosen_token_stats(logp, probs, choice)
        token_logp[active, t] = stats["logprob"]
        for name, value in stats.items():
            sums[name][active] += value
        tokens[active, t] = next_tokens
        lengths[active] += 1
        ended = torch.isin(next_tokens, eos)
        if params.stop:
            ended |= _stop_strings(tokenizer, tokens[active, : t + 1], active.tolist(), texts, params.stop)
        stopped[active[ended]] = True
        if t + 1 == params.max_new_tokens or bool(ended.all()):
            break
        if bool(ended.any()):
            keep = (~ended).nonzero().squeeze(1)
            prefix.select(keep)
            active, next_tokens = active[keep], next_tokens[keep]
        inputs = continuation(prefix, next_tokens[:, None], generated[: len(active), : t + 1])
        logits = model(**inputs).logits[:, -1]
    n_tokens = lengths.tolist()
    rows_tokens, rows_logp = (_cut(rows.tolist(), n_tokens) for rows in (tokens, token_logp))
    return rows_tokens, stopped.tolist(), {name: value.tolist() for name, value in sums.items()}, rows_logp


def _policy_scores(
    logits: torch.Tensor, samplable: torch.Tensor, params: SamplingParams, greedy: bool, t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The active rows' tempered scores (A, V') over the samplable tokens and the policy's log-probs of them, at
    response token t + 1; raises NonFiniteLogits when they are not finite."""
    scores = logits.index_select(1, samplable).float()  # (A, V'): suppressed tokens have probability 0
    if not greedy and params.temperature != 1.0:
        scores = scores / params.temperature
    logp = torch.log_softmax(scores, dim=-1)  # the policy's log-probs
    if not bool(torch.isfinite(logp).all()):  # NaN/inf logits would sample out-of-range token indices
        raise NonFiniteLogits(
            f"its forward pass gave non-finite logits at response token {t + 1} (its weights or activations "
            "hold NaN or infinity: a diverged model, or an overflow in its compute dtype)"
        )
    return scores, logp


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
    (token_entropy / token_self_certainty of vlm_corl.training.grpo), from one log-softmax over the V' tokens."""
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


def _stop_strings(
    tokenizer, tokens: torch.Tensor, rows: list[int], texts: list[str], stop: tuple[str, ...]
) -> torch.Tensor:
    """(A,) whether each of `rows` (tokens: (A, t) so far) now holds a stop string overlapping its last token.

    texts[row] keeps each row's decoded response, so only the new end is searched."""
    hit = torch.zeros(len(rows), dtype=torch.bool, device=tokens.device)
    for i, (row, ids) in enumerate(zip(rows, tokens.tolist())):
        before = len(texts[row])
        texts[row] = tokenizer.decode(ids)
        hit[i] = any(texts[row].find(s, max(0, before - len(s) + 1)) != -1 for s in stop)
    return hit

"""Rollouts with Hugging Face `generate` (any machine): batched sampling of K responses per prompt.

The engine samples from the member's own module, so weights are always current. Temperature, top-k and
top-p are applied by our own processor list, not by `generate`'s defaults, so that the per-token statistics
recorded on the way (sampled log-prob, entropy, self-certainty) describe exactly the distribution sampled.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from vlm_corl.batching import collate
from vlm_corl.grpo import token_entropy, token_self_certainty
from vlm_corl.rollout import Prompt, Response, RolloutGroup, SamplingParams


class _StepStats(LogitsProcessor):
    """Records, at every decoding step, the entropy and self-certainty of the (tempered) distribution, and
    the log-prob of the token sampled at the previous step. Sits after temperature, before top-k/top-p."""

    def __init__(self):
        self.entropy: list[torch.Tensor] = []  # per step (BK,)
        self.certainty: list[torch.Tensor] = []
        self.logprob: list[torch.Tensor] = []
        self._last_logp: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take_sampled(input_ids[:, -1])
        self._last_logp = torch.log_softmax(scores.float(), dim=-1)
        self.entropy.append(token_entropy(scores))
        self.certainty.append(token_self_certainty(scores))
        return scores

    def _take_sampled(self, tokens: torch.Tensor) -> None:
        if self._last_logp is not None:
            self.logprob.append(self._last_logp.gather(-1, tokens[:, None]).squeeze(-1))

    def finish(self, last_tokens: torch.Tensor) -> None:
        """Close the last step once generation has sampled its final token."""
        self._take_sampled(last_tokens)
        self._last_logp = None

    def sums(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-sequence sums over the (BK, T) response mask."""
        t = mask.shape[1]
        return {
            # where, not a product: positions after eos may hold -inf (suppressed pad tokens), and -inf * 0 is nan
            name: torch.where(mask.bool(), torch.stack(values[:t], dim=1), 0.0).sum(dim=1)
            for name, values in (("logprob", self.logprob), ("entropy", self.entropy), ("self_certainty", self.certainty))
        }


class HFEngine:
    """Rollout engine over `model.generate` of a loaded member (see `vlm_corl.member.Member`)."""

    def __init__(self, member):
        self.member = member

    def sync_weights(self) -> None:
        """Nothing to do: generation uses the member's live module."""

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[RolloutGroup]:
        member = self.member
        tok = member.tokenizer
        inputs, _ = collate([p.inputs for p in prompts], tok.pad_token_id)
        stats = _StepStats()
        sample = params.temperature > 0  # temperature 0 = greedy decoding (evaluation)
        processors = [TemperatureLogitsWarper(params.temperature)] if sample and params.temperature != 1.0 else []
        processors.append(stats)
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        model = member.generation_module
        was_training = model.training
        model.eval()
        # fork_rng: a member's sampling stream is a pure function of its seed, whatever ran before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(params.seed)
            out = model.generate(
                **inputs,
                do_sample=sample,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=params.n,
                max_new_tokens=params.max_new_tokens,
                logits_processor=LogitsProcessorList(processors),
                stop_strings=list(params.stop) or None,
                tokenizer=tok,
                pad_token_id=tok.pad_token_id,
            )
        model.train(was_training)
        new = out[:, inputs["input_ids"].shape[1] :]  # (B*K, T)
        stats.finish(new[:, -1])
        lengths, finished = _response_lengths(new, member.eos_token_ids, tok.pad_token_id)
        mask = (torch.arange(new.shape[1])[None, :] < lengths[:, None]).float()
        sums = stats.sums(mask)
        groups = []
        for i, prompt in enumerate(prompts):
            group = RolloutGroup(prompt)
            for j in range(i * params.n, (i + 1) * params.n):
                ids = new[j, : lengths[j]].tolist()
                text = tok.decode(ids, skip_special_tokens=True)
                stopped = bool(finished[j]) or any(s in text for s in params.stop)
                group.responses.append(
                    Response(
                        token_ids=ids,
                        text=text,
                        finish_reason="stop" if stopped else "length",
                        logprob_sum=float(sums["logprob"][j]),
                        entropy_sum=float(sums["entropy"][j]),
                        self_certainty_sum=float(sums["self_certainty"][j]),
                    )
                )
            groups.append(group)
        return groups


def _response_lengths(tokens: torch.Tensor, eos_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths, finished) per row: the length up to and including the first eos, and whether there was one.

    A row stopped by a stop string has no eos; `generate` pads it after the stop, so its trailing pads go.
    """
    is_eos = torch.isin(tokens, torch.tensor(eos_ids))
    finished = is_eos.any(dim=1)
    trailing_pads = (tokens == pad_id).long().flip(1).cumprod(1).sum(1)
    unpadded = tokens.shape[1] - trailing_pads
    lengths = torch.where(finished, is_eos.long().argmax(dim=1) + 1, unpadded)
    return lengths, finished

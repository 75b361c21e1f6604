"""The rollout records: typed records that leave the render and rollout phases (a rendered prompt, a response,
a group of K, how to sample, what a policy is beyond its weights). This module imports nothing of ours: the
engines (`vlm_corl.members.engines`) and everything downstream (extract, reward, update) stand on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from PIL import Image


@dataclass
class Prompt:
    """One example rendered for one member: chat-templated text, its images, and the processor's tensors."""

    example_id: str
    text: str
    images: list[Image.Image]
    inputs: dict[str, torch.Tensor]  # processor output for this prompt alone (batch dim 1)


@dataclass
class Response:
    """One sampled response. `token_ids` exclude the prompt and stop after the first end-of-sequence token."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos or a stop string) | "length"
    # Per-token statistics of the sampling distribution (temperature applied), summed over response tokens:
    # log-prob of the sampled tokens, entropy, self-certainty KL(U || p). None when the engine lacks them.
    logprob_sum: float | None = None
    entropy_sum: float | None = None
    self_certainty_sum: float | None = None
    # The engine's log-prob of each sampled token (for the off-policy correction, algo.rollout_is); None when
    # the engine could not give the untruncated policy's.
    token_logprobs: list[float] | None = None

    def mean(self, stat: str) -> float | None:
        """Per-token mean of a summed statistic (e.g. "entropy")."""
        total = getattr(self, f"{stat}_sum")
        return None if total is None else total / max(len(self.token_ids), 1)


@dataclass
class RolloutGroup:
    """The K responses of one member to one prompt."""

    prompt: Prompt
    responses: list[Response] = field(default_factory=list)


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples (set from `RolloutConfig`)."""

    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int = 0
    first_position: int = 0  # batch position of the first prompt: each prompt's random stream follows from it


@dataclass(frozen=True)
class Policy:
    """What a member's policy is beyond its weights, as the rollout samples it and the update scores it: the
    sampling temperature, the control tokens it never emits (`suppressed`, removed from the distribution),
    the id batches are padded with, and whether the model computes its 3-D rotary positions itself (Qwen-VL's
    M-RoPE). `Member.policy(temperature)` builds it."""

    pad_id: int
    temperature: float = 1.0
    suppressed: tuple[int, ...] = ()
    mrope: bool = False

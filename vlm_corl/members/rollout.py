"""The rollout interface: typed records that leave the render and rollout phases, and the engine factory.

Engines (`vlm_corl.members.engines.hf`, `vlm_corl.members.engines.vllm`) turn a member's rendered prompts into K sampled
responses each. Everything downstream (extract, reward, update) reads only these records.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from PIL import Image

if TYPE_CHECKING:
    from vlm_corl.config.schema import RolloutConfig
    from vlm_corl.members.member import Member


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


class RolloutEngine(Protocol):
    """Samples K responses per prompt with the member's current weights."""

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[RolloutGroup]:
        """One group per prompt, in order."""
        ...

    def sync_weights(self) -> None:
        """Make the engine sample from the member's latest weights (no-op when it shares the module)."""
        ...

    def sleep(self) -> None:
        """Before the member's update: give back the device memory the update needs (vLLM's sleep mode).
        Until `sync_weights` and `wake`, the engine may not generate."""
        ...

    def wake(self) -> None:
        """After the sync: take the memory back, ready to generate."""
        ...


def make_engine(
    name: str,
    member: Member,
    rollout: RolloutConfig | None = None,
    max_images_per_prompt: int = 1,
    share: float = 1.0,
    max_image_pixels: int | None = None,
) -> RolloutEngine:
    """Build the rollout engine `name` ("hf" or "vllm") for a loaded member; vLLM is imported only here.

    `rollout` (a RolloutConfig) carries the vLLM settings; `max_images_per_prompt` sizes its image budget and
    `max_image_pixels` the pictures it profiles; `share` is this engine's part of the process's vLLM memory
    budget (several engines on one device).
    """
    if name == "hf":
        from vlm_corl.members.engines.hf import HFEngine

        return HFEngine(member)
    if name == "vllm":
        from vlm_corl.members.engines.vllm import VLLMEngine

        return VLLMEngine(
            member,
            rollout,
            max_images_per_prompt=max(max_images_per_prompt, 1),
            share=share,
            max_image_pixels=max_image_pixels,
        )
    raise ValueError(f"unknown rollout engine {name!r}; use 'hf' or 'vllm'")


def release_engines() -> None:
    """Before the trainer destroys its process groups: let vLLM (when loaded) tear down its own first."""
    if "vllm" in sys.modules:
        from vlm_corl.members.engines.vllm import release_distributed_state

        release_distributed_state()

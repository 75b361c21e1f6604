"""Rollout engines: `hf` (the member's own Hugging Face module, any machine) and `vllm` (imported lazily, only
when built), behind one interface (`RolloutEngine`), and the factory that builds them (`make_engine`).
Engines read and write only the rollout records of `vlm_corl.members.rollout`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Protocol

from vlm_corl.members.rollout import Prompt, RolloutGroup, SamplingParams

if TYPE_CHECKING:
    from vlm_corl.config.schema import RolloutConfig
    from vlm_corl.members.member import Member


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

        return HFEngine(member, rollout.hf_static_cache if rollout is not None else "auto")
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

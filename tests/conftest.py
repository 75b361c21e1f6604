"""Shared fixtures: the offline tiny-model zoo, built once per test session."""

from __future__ import annotations

import pytest
import torch

from vlm_corl.zoo import build_zoo

# One torch thread: on a shared 2-core machine two threads collapse 20-30x as soon as another process is busy.
torch.set_num_threads(1)

# Named, not "every registered family": a test may register a stand-in family that cannot be built.
ZOO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mllama", "gemma3", "internvl", "qwen3", "qwen2", "llama")


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> dict:
    """{family: path} of every family's tiny member (seed 0), built once (~5 s) into a session temp dir."""
    return build_zoo(tmp_path_factory.mktemp("zoo"), families=list(ZOO_FAMILIES), size="tiny", seed=0)

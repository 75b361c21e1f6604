"""Shared fixtures: the offline tiny-model zoo and two warm-started base models (built once per test session), and
the recording stand-in for `vllm` (tests/fake_vllm.py)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
from cohort_helpers import shipped_families
from fake_vllm import fake_vllm  # noqa: F401 (a fixture: the recording stand-in for vllm)

from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.member import load_member
from vlm_corl.models.warmstart import Schedule, warm_start
from vlm_corl.models.zoo import build_zoo, member_dir

# The picture-check cache (vlm_corl.data.image_checks) of this session's processes, theirs alone: never the user's
# ~/.cache, where a run of the suite would leave its entries and find those of another.
os.environ.setdefault("VLM_CORL_DATA_CACHE", tempfile.mkdtemp(prefix="vlm_corl_data_cache_"))

# One torch thread: on a shared 2-core machine two threads collapse 20-30x as soon as another process is busy.
torch.set_num_threads(1)

# The shipped families, read before a test may register a stand-in family that cannot be built.
ZOO_FAMILIES = shipped_families()


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> dict:
    """{family: path} of every family's tiny member (seed 0), built once (~5 s) into a session temp dir, or read
    from VLM_CORL_TINY_ZOO (`corl zoo --size tiny` run where every processor can be built: the GPU stack's lane)."""
    prebuilt = os.environ.get("VLM_CORL_TINY_ZOO")
    if prebuilt:
        zoo = {family: member_dir(prebuilt, family) for family in ZOO_FAMILIES}
        missing = [family for family, path in zoo.items() if not (path / "config.json").is_file()]
        assert not missing, f"VLM_CORL_TINY_ZOO={prebuilt} lacks {missing}: build it with corl zoo --size tiny"
        return zoo
    return build_zoo(tmp_path_factory.mktemp("zoo"), families=list(ZOO_FAMILIES), size="tiny", seed=0)


@pytest.fixture(scope="session")
def base_models(tiny_zoo, tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen2-VL and Mllama members warm-started on 500 labelled easy-vqa questions, so they answer in
    their format and agree sometimes: label-free rewards are then non-zero."""
    out = tmp_path_factory.mktemp("base")
    examples = load_examples("easyvqa", split="train", limit=500).examples
    paths = {}
    for family in ("qwen2_vl", "mllama"):
        torch.manual_seed(0)
        member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family])))
        warm_start(member, examples, Schedule(steps=60, batch_size=16, lr=3e-3, seed=0))
        member.save(out / family)
        paths[family] = out / family
    return paths

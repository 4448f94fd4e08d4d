# lmforge: the two commands a fresh machine needs are `make smoke` and `make test` (see README).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Which torch the venv gets (TORCH_VARIANT):
#   auto   (default) on a machine with nvidia-smi the venv sees the system's CUDA torch; elsewhere the CPU
#          wheel, as cpu (PyPI's Linux wheel of torch is the CUDA build, several GB, which a CPU machine never uses)
#   cpu    the CPU wheel from the PyTorch CPU index
#   cuNNN  the CUDA wheel from the PyTorch index for CUDA N.N.N (e.g. cu128), for a GPU environment built on a
#          login node without GPUs:  make install TORCH_VARIANT=cu128
TORCH_VERSION ?= 2.13.0
# Default: the variant the venv was built with (so `make test` after a cu128 install keeps it), else auto.
TORCH_VARIANT ?= $(or $(shell cat $(VENV)/.torch-variant 2>/dev/null),auto)
TORCH_INDEX ?= https://download.pytorch.org/whl
ifneq ($(filter-out auto cpu,$(TORCH_VARIANT)),)
ifeq ($(shell [[ "$(TORCH_VARIANT)" =~ ^cu[0-9]{3}$$ ]] && echo ok),)
$(error TORCH_VARIANT=$(TORCH_VARIANT) is not auto, cpu or cuNNN (e.g. cu128); see the Makefile's header)
endif
endif
HAS_GPU := $(if $(filter auto,$(TORCH_VARIANT)),$(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1))
VENV_FLAGS := $(if $(HAS_GPU),--system-site-packages,)
TORCH_WHEEL := $(if $(filter auto,$(TORCH_VARIANT)),cpu,$(TORCH_VARIANT))
TORCH_INSTALL := $(if $(HAS_GPU),true,$(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX)/$(TORCH_WHEEL))
PYTEST_ARGS ?=

.PHONY: install smoke lint test-fast test test-drills durations coverage bench clean

install: $(VENV)/.installed-$(TORCH_VARIANT)

# One stamp per variant: `make install TORCH_VARIANT=cu128` on a venv built for cpu replaces its torch.
$(VENV)/.installed-$(TORCH_VARIANT): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(TORCH_INSTALL)
	$(PY) -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	echo $(TORCH_VARIANT) > $(VENV)/.torch-variant
	touch $@

smoke: install
	$(VENV)/bin/lmforge train +exp=smoke

# The test tiers (docs/testing.md): fast = tests/unit in-process (<= 5 min on 2 cores); test = fast + the
# multi-rank, e2e and Slurm tests (the README's command, what CI runs); drills = long fault and scale drills.
# tests/run_tiers.py runs each tier as its own pytest and prints its wall time, CPU-seconds and load.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-fast: lint
	$(PY) tests/run_tiers.py fast $(TIER_FLAGS) -- $(PYTEST_ARGS)

test: lint
	$(PY) tests/run_tiers.py fast full $(TIER_FLAGS) -- $(PYTEST_ARGS)

test-drills: install
	$(PY) tests/run_tiers.py drills $(TIER_FLAGS) -- $(PYTEST_ARGS)

# Refresh tests/durations.json (every tier; commit it when tests change): the fast tier's measured-cost rule and
# the slowest tests are read from it without running them.
durations: install
	$(PY) -m pytest --tier all --store-durations --clean-durations --durations-path tests/durations.json $(PYTEST_ARGS)

# Line and branch coverage of platform/lmforge, subprocesses included (untimed: coverage slows every process).
coverage: install
	rm -rf .cache/coverage && mkdir -p .cache/coverage
	COVERAGE_RCFILE=$(CURDIR)/.coveragerc LMFORGE_COVERAGE_DIR=$(CURDIR)/.cache/coverage $(PY) -m coverage run -m pytest --tier all -p no:cacheprovider $(PYTEST_ARGS); \
	  rc=$$?; export COVERAGE_RCFILE=$(CURDIR)/.coveragerc LMFORGE_COVERAGE_DIR=$(CURDIR)/.cache/coverage; \
	  $(PY) -m coverage combine -q && $(PY) -m coverage report | tail -n 1 && $(PY) -m coverage json -q -o .cache/coverage/coverage.json; \
	  exit $$rc

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) runs outputs .cache .pytest_cache

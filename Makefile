# lmforge: the two commands a fresh machine needs are `make smoke` and `make test` (see README).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Which torch the venv gets (TORCH_VARIANT):
#   auto   (default) on a machine with nvidia-smi the venv sees the system's CUDA torch; elsewhere torch from PyPI
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
TORCH_INSTALL := $(if $(filter auto,$(TORCH_VARIANT)),$(if $(HAS_GPU),true,$(PY) -m pip install -q torch==$(TORCH_VERSION)),$(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX)/$(TORCH_VARIANT))
PYTEST_ARGS ?=

.PHONY: install smoke test bench clean

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

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) runs outputs .cache .pytest_cache

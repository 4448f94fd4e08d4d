# lmforge: the two commands a fresh machine needs are `make smoke` and `make test` (see README).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# On a GPU machine the venv sees the system's CUDA torch; elsewhere the CPU wheel is installed first.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
VENV_FLAGS := $(if $(HAS_GPU),--system-site-packages,)
PYTEST_ARGS ?=

.PHONY: install smoke test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(HAS_GPU),true,$(PY) -m pip install -q torch==2.13.0)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

smoke: install
	$(VENV)/bin/lmforge train +exp=smoke

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) runs outputs .cache .pytest_cache

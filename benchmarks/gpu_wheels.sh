#!/usr/bin/env bash
# The wheels the GPU check needs beyond the device machine's own Python (torch, numpy, PyYAML are there; it
# reaches no package index): omegaconf (the planner validates through it) and torchao (train.precision=fp8).
# Run once where pip reaches an index, from the repository root; .whl/ is ignored by git and travels with the
# check (`carry: [".whl"]`); benchmarks/gpu_check.sh installs what it finds there.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl \
  torchao==0.18.0 omegaconf==2.3.1 PyYAML==6.0.4
# antlr4's runtime for omegaconf is a source distribution only: build its (pure Python) wheel here.
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -l .whl

#!/usr/bin/env bash
# The prepared GPU check: run on a lent H200 (device tool) from the repository root, < 8 minutes.
#   bash benchmarks/gpu_check.sh
# Uses the machine's own torch; imports only lmforge's model/flops/hardware modules (no hydra/wandb needed).
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 460 python3 benchmarks/gpu_check.py 2>&1 | tee "${OUT:-.}/gpu_check.log"

#!/usr/bin/env bash
# The prepared GPU check: run ONCE on a lent H200 (device tool) from the repository root, < 8 minutes.
#   bash benchmarks/gpu_check.sh
# Uses the machine's own torch; imports only lmforge's model/config dataclasses/parallel/comm/optimizer modules
# (no hydra/omegaconf/wandb/deepspeed needed). Results: $OUT/gpu_check.json (rewritten after every check, so a
# timeout still returns what finished) and $OUT/gpu_check.log; without $OUT in benchmarks/results/scratch/. A run
# that docs/performance.md quotes is copied to benchmarks/results/<device-kind>/ and committed. Rehearse anywhere first:
#   python benchmarks/gpu_check.py --dry-run
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results/scratch}  # the device machine sets $OUT; elsewhere the benchmarks' scratch
mkdir -p "$OUT"
export OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The wheels benchmarks/gpu_wheels.sh fetched (carried as .whl/): omegaconf for the planner, torchao for fp8.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The script stops starting checks at its own 440 s budget; SIGTERM at 455 s records the check it interrupted.
timeout --kill-after=10 455 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check exit status: $rc (0: every check passed; 1: a check failed or was skipped; 124: timeout)"
exit "$rc"

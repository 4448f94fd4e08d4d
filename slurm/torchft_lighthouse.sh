#!/bin/bash
# The torchft Lighthouse of a replica-FT run on Slurm, as a job of its own (one task). Submitted by
# slurm/torchft_supervisor.sh (python -m lmforge.launch.replica_ft_slurm), which passes torchft_lighthouse's options:
#
#   sbatch --nodes=1 --ntasks=1 slurm/torchft_lighthouse.sh --min_replicas 2 --bind 0.0.0.0:29510
#
# The replica groups reach it at http://<this job's node>:<port>; it runs until the supervisor cancels it.
#SBATCH --job-name=lmforge-lighthouse
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --no-requeue
set -euo pipefail
source "${LMFORGE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/env.sh"
# beside the interpreter, in its environment's scripts folder (a venv's bin/, whether or not it is activated, and
# LMFORGE_PYTHON may be a wrapper), or on PATH
lighthouse=$(dirname "$LMFORGE_PYTHON")/torchft_lighthouse
[ -x "$lighthouse" ] || lighthouse=$("$LMFORGE_PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)/torchft_lighthouse
[ -x "$lighthouse" ] || lighthouse=$(command -v torchft_lighthouse) || {
  echo "torchft_lighthouse.sh: torchft_lighthouse is not installed beside $LMFORGE_PYTHON. Fix: pip install lmforge[ft]" >&2
  exit 2
}
echo "lmforge: torchft Lighthouse on $(hostname) ($(date -u +%FT%TZ)): $*"
exec "$lighthouse" "$@"

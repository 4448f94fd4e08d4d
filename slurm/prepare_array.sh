#!/bin/bash
# Sharded data preparation as a Slurm job array (submitted by `lmforge data prepare ... --launcher slurm-array`).
#
#   lmforge data prepare 'corpus/*.parquet' --out /shared/prep --shard-size 64 --launcher slurm-array --array-tasks 16
#
# submits, after writing /shared/prep/plan.json:
#   sbatch --array=0-15 slurm/prepare_array.sh /shared/prep --tokenizer T --cache-dir C --workers W
#   sbatch --dependency=afterok:<array> slurm/prepare_array.sh /shared/prep --finalize
# Array task t builds the shards i with i % 16 == t (finished shards are skipped: a requeued or re-submitted
# task resumes). The finalize job checks every shard and writes manifest.json, which marks the prefix complete.
#SBATCH --job-name=lmforge-prepare
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
source "${LMFORGE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/env.sh"

out=${1:?usage: prepare_array.sh OUT_DIR [lmforge data prepare options]}
shift
if [ "${1:-}" = "--finalize" ]; then
  echo "lmforge prepare: finalize $out on $(hostname)"
  exec "$LMFORGE_PYTHON" -m lmforge.data.prepare --out "$out" --finalize
fi
task=${SLURM_ARRAY_TASK_ID:?submit with --array}
count=${SLURM_ARRAY_TASK_COUNT:?submit with --array}
echo "lmforge prepare: task $task of $count on $(hostname)"
exec "$LMFORGE_PYTHON" -m lmforge.data.prepare --out "$out" --task-index "$task" --num-tasks "$count" "$@"

#!/bin/bash
# A sweep as a Slurm job array: one array task per line of a points file, each a full train.sh run.
#
#   # points.txt: one line of Hydra overrides per sweep point
#   #   model=gpt_125m optim.lr=1e-3
#   #   model=gpt_125m optim.lr=3e-3
#   sbatch --array=0-1%2 slurm/sweep_array.sh points.txt +exp=gpt_125m train.max_steps=2000
#
# Task i runs `slurm/train.sh <common overrides> <line i>` in place (exec), so every point gets the same
# preemption forwarding, requeue and retry budget as a single job. A line is split as the shell would split it,
# without expanding anything: `a='x y'` is one override `a=x y` (so `lmforge sweep plan`'s overrides.txt, whose
# lines are shell-quoted, works here too). Each point's run directory is runs/slurm-<array job id>_<task id>
# (lmforge.runtime.rundir), stable across requeues of that task, unless the overrides name one.
# A sweep planned by `lmforge sweep plan` (sweep.json) is run by slurm/sweep_worker.sh instead
# (`lmforge sweep run --launcher slurm-array`): given a .json file this script refuses it.
#SBATCH --job-name=lmforge-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
#SBATCH --error=slurm-%x-%A_%a.err
set -euo pipefail
source "${LMFORGE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/env.sh"

points=${1:?usage: sbatch --array=0-N slurm/sweep_array.sh POINTS_FILE [common overrides]}
shift
task=${SLURM_ARRAY_TASK_ID:?submit with --array}
case "$points" in
  *.json)
    echo "lmforge sweep: $points is a sweep file, not a points file (one line of overrides per point); submit it with \`lmforge sweep run --launcher slurm-array\` (slurm/sweep_worker.sh)" >&2
    exit 2 ;;
esac
line=$(grep -v '^[[:space:]]*\(#\|$\)' "$points" | sed -n "$(( task + 1 ))p")
if [ -z "$line" ]; then
  echo "lmforge sweep: $points has no point $task (it has $(grep -cv '^[[:space:]]*\(#\|$\)' "$points"))" >&2
  exit 2
fi
mapfile -t point < <("$LMFORGE_PYTHON" -c 'import shlex, sys; print(*shlex.split(sys.argv[1]), sep="\n")' "$line")
echo "lmforge sweep: task $task: ${point[*]}"
exec bash "$LMFORGE_REPO/slurm/train.sh" "$@" "${point[@]}"

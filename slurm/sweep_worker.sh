#!/bin/bash
# A sweep planned by `lmforge sweep plan` as a Slurm job array: array task i trains run i of the sweep
# (its stable runs first, then its points: the numbering of sweep.json's units).
#
#   lmforge sweep run runs/demo --launcher slurm-array      # submits, for the pending runs:
#   sbatch --array=<pending indices> --job-name=sweep-demo slurm/sweep_worker.sh /abs/runs/demo/sweep.json
#
# Task i runs `python -m lmforge.scaling.worker SWEEP_JSON --index i` in this batch shell, one process (the
# sweep's points are single-process runs; $LMFORGE_PYTHON must be Python itself, or a wrapper that execs it, since
# the preemption signal goes to that process). The contract of slurm/train.sh, for that one process:
#   * preemption / time limit: Slurm sends USR1 `lead` seconds early (--signal=B:USR1@lead); it is forwarded to
#     the worker, which finishes the step, checkpoints and exits 42 (lmforge.fault.exitcodes);
#   * after the run, `lmforge.scaling.worker --after-exit-code` decides done / requeue / stop
#     (lmforge.fault.retry: a preemption requeues; a crash requeues within cluster.max_requeues; a deterministic
#     verdict stops with its exit code) and a requeue is `scontrol requeue` of this array task, which keeps its
#     index, hence its run directory, and resumes from the newest complete checkpoint (train.resume=auto).
# A wsd-branches sweep's branches are arrays of their own, each waiting for its stable run's task
# (--dependency=afterok:<job>_<task>); a requeued stable run keeps its branches waiting until it completes.
#SBATCH --job-name=lmforge-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out
#SBATCH --error=slurm-%x-%A_%a.err
set -uo pipefail
source "${LMFORGE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/env.sh"

sweep=${1:?usage: sbatch --array=I,J,... slurm/sweep_worker.sh SWEEP_JSON (lmforge sweep run --launcher slurm-array submits it)}
task=${SLURM_ARRAY_TASK_ID:?submit with --array (lmforge sweep run --launcher slurm-array does)}
case "$sweep" in
  *.json) ;;
  *) echo "lmforge sweep: $sweep is not a sweep file (sweep.json from \`lmforge sweep plan\`); for a file of override lines use slurm/sweep_array.sh" >&2; exit 2 ;;
esac
echo "lmforge sweep: job ${SLURM_ARRAY_JOB_ID}_${task} run $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on ${SLURMD_NODENAME:-$(hostname)}: $sweep --index $task"

PREEMPTED=0
WORKER_PID=
forward_preemption() {
  [ "$PREEMPTED" = 1 ] && return 0
  PREEMPTED=1
  echo "lmforge sweep: preemption signal at ${EPOCHREALTIME}; asking the worker to checkpoint" >&2
  [ -n "$WORKER_PID" ] && kill -USR1 "$WORKER_PID" 2>/dev/null
  return 0
}
trap forward_preemption USR1 TERM

"$LMFORGE_PYTHON" -m lmforge.scaling.worker "$sweep" --index "$task" &
WORKER_PID=$!
rc=0
while true; do
  wait "$WORKER_PID"; rc=$?
  # wait returns >128 when a trapped signal interrupted it; the worker is still running then.
  if kill -0 "$WORKER_PID" 2>/dev/null; then continue; fi
  break
done
echo "lmforge sweep: task $task ended with exit code $rc (preempted=$PREEMPTED)"

trap - USR1 TERM   # from here on a signal is Slurm ending this run (requeue, cancel), not a preemption request
signalled=()
[ "$PREEMPTED" = 1 ] && signalled=(--signalled)
decision=$("$LMFORGE_PYTHON" -m lmforge.scaling.worker "$sweep" --index "$task" --after-exit-code "$rc" "${signalled[@]}")
read -r action code <<< "$decision"
case "$action" in
  done) exit 0 ;;
  requeue)
    scontrol requeue "$SLURM_JOB_ID"   # this array task's own job id: Slurm ends this script
    sleep 5; exit 0 ;;
  stop) exit "${code:-1}" ;;
  *) exit "$(( rc == 0 ? 1 : rc ))" ;;
esac

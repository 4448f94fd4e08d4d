#!/bin/bash
# lmforge training job. Hydra overrides are the arguments:
#
#   sbatch slurm/train.sh +exp=gpt_1b optim.lr=2e-4
#   sbatch --nodes=4 --time=24:00:00 --gpus-per-node=8 --cpus-per-task=64 --exclusive slurm/train.sh +exp=gpt_1b
#   lmforge launch --slurm --nodes 4 +exp=gpt_1b     # the same, GPU/CPU/exclusive flags from the cluster config
#
# What it does (docs/slurm.md, docs/fault-tolerance.md):
#   * one torchrun agent per node (`srun slurm/agent.sh`), cluster.gpus_per_node workers each, c10d
#     rendezvous on the job's first node at its NodeAddr (never localhost on a multi-node job);
#   * in-job restarts: torchrun --max_restarts=fault.max_restarts (lmforge.launch.agent: torchrun that does not
#     restart after a deterministic verdict); a killed or hung rank (watchdog) restarts the group, which
#     resumes from the newest complete checkpoint (train.resume=auto);
#   * preemption / time limit: Slurm sends USR1 to this script `lead` seconds early (--signal=B:USR1@lead);
#     it is forwarded to the workers, which finish the step, checkpoint and stop; the job requeues itself;
#   * after the run, lmforge.launch.jobctl decides finish / requeue / stop (retry budget
#     cluster.max_requeues for crashes; a deterministic failure, e.g. a config error or a divergence, is never
#     retried: the job ends with its message and exit code; corrupted replicas on named hosts are retried without
#     them) and requeues with `scontrol requeue`, leaving the nodes at fault (unhealthy in Slurm, the host of a
#     corrupt replica, or a repeated straggler) out of the next run (ExcNodeList, set while the
#     job is pending; optionally fewer nodes: cluster.min_nodes). A requeued job keeps its job id, hence its run
#     directory (runs/slurm-<jobid>), and resumes.
#   * node failure: Slurm requeues the job itself and ends this script (its TERM is logged as such, not as a
#     preemption); the next run's prepare step records that attempt in <run>/requeues.json.
#
# Resources: #SBATCH lines cannot be computed from the config, so the lines below hold only what every job
# needs (one task per node: the torchrun agent); the rest comes from the sbatch command line, which
# `lmforge launch --slurm` builds from the cluster config: --gpus-per-node=cluster.gpus_per_node (GPU
# configs), --cpus-per-task (cluster.cpus_per_task, else gpus_per_node x threads), --exclusive
# (cluster.exclusive). The node count is the allocation's: `sbatch --nodes=8 slurm/train.sh +exp=gpt_1b`
# sets cluster.nodes=8; an explicit, different cluster.nodes is refused. The prepare step checks that the
# allocation has the GPUs and CPUs the config needs and refuses the job, naming both, when it has not.
#SBATCH --job-name=lmforge
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
#SBATCH --error=slurm-%x-%j.err
set -uo pipefail

source "${LMFORGE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}/slurm/env.sh"
cd "$LMFORGE_REPO" 2>/dev/null || true
cd "${SLURM_SUBMIT_DIR:-$PWD}"

echo "lmforge: job ${SLURM_JOB_ID} run $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on ${SLURM_JOB_NODELIST} ($(date -u +%FT%TZ))"

# Prepare: every check that needs no worker, on this (the first) node with the job's real allocation: the node
# count, the device contract, the layout for this world size, memory fit, GPUs/CPUs allocated. A job that
# cannot run ends here with exit 2 and one line in the job's error log, before srun starts anything.
prep=$("$LMFORGE_PYTHON" -m lmforge.launch.jobctl prepare -- "$@"); prep_rc=$?
if [ "$prep_rc" != 0 ]; then
  echo "lmforge: prepare refused the job (exit $prep_rc); no worker was started" >&2
  exit "$prep_rc"
fi
eval "$prep"
# One source of truth for the node count: the allocation's (cluster.nodes=$SLURM_NNODES unless given and equal);
# and a job's own run directory (runs/slurm-<jobid>) unless the command line names one (run.name=null when the
# name came from a preset such as +exp=smoke). The overrides hold no spaces: split on them.
# shellcheck disable=SC2206
[ -n "${LMFORGE_JOB_OVERRIDES:-}" ] && set -- "$@" ${LMFORGE_JOB_OVERRIDES}

head_node=$(lmforge_head_node)
MASTER_ADDR=$(lmforge_node_addr "$head_node")
MASTER_PORT=$(lmforge_master_port)
if [ "${SLURM_NNODES:-1}" -gt 1 ] && why=$(lmforge_is_loopback "$MASTER_ADDR"); then
  echo "lmforge: head node $head_node: $why, unreachable from the other nodes of this ${SLURM_NNODES}-node job; give $head_node a NodeAddr the other nodes reach (slurm.conf) or fix its /etc/hosts line" >&2
  exit 2
fi
export MASTER_ADDR MASTER_PORT
echo "lmforge: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT head=$head_node run_dir=$LMFORGE_RUN_DIR"

PREEMPTED=0
SRUN_PID=
forward_preemption() {  # $1: the signal's name
  [ "$PREEMPTED" = 1 ] && return 0
  if [ "$1" = TERM ] && why=$(slurm_ending_run); then
    # Not a request to checkpoint: Slurm already ended this run (a node of the job failed, or scontrol requeue /
    # scancel), and kills what is left of it in KillWait seconds. The next run resumes from the last checkpoint.
    echo "lmforge: TERM at ${EPOCHREALTIME}: Slurm is ending this run ($why); not a preemption, no checkpoint" >&2
    return 0
  fi
  PREEMPTED=1
  echo "lmforge: preemption signal ($1) at ${EPOCHREALTIME}; asking the workers to checkpoint" >&2
  # To every process of the job's steps (not this script): the workers checkpoint, the agents ignore USR1.
  scancel --signal=USR1 "$SLURM_JOB_ID" 2>/dev/null || true
}
# Prints why when Slurm has already ended this run: the job is no longer RUNNING, or Slurm counted a restart this
# run has not made (a requeue after a node failure increments Restarts at once).
slurm_ending_run() {
  local info state restarts
  info=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null) || return 1
  state=$(grep -o 'JobState=[A-Z_]*' <<< "$info"); state=${state#JobState=}
  restarts=$(grep -o 'Restarts=[0-9]*' <<< "$info"); restarts=${restarts#Restarts=}
  if [ -n "$state" ] && [ "$state" != RUNNING ]; then
    echo "job state $state, Slurm restarts ${restarts:-?}"
  elif [ "${restarts:-0}" -gt "${SLURM_RESTART_COUNT:-0}" ]; then
    echo "requeued by Slurm: restart ${restarts}"
  else
    return 1
  fi
}
trap 'forward_preemption USR1' USR1
trap 'forward_preemption TERM' TERM

srun --kill-on-bad-exit=0 --ntasks-per-node=1 --export=ALL "$LMFORGE_REPO/slurm/agent.sh" "$@" &
SRUN_PID=$!
rc=0
while true; do
  wait "$SRUN_PID"; rc=$?
  # wait returns >128 when a trapped signal interrupted it; the step is still running then.
  if kill -0 "$SRUN_PID" 2>/dev/null; then continue; fi
  break
done
echo "lmforge: training step ended with exit code $rc (preempted=$PREEMPTED)"

trap - USR1 TERM   # from here on a signal is Slurm ending this run (requeue, cancel), not a preemption request
signalled=()
[ "$PREEMPTED" = 1 ] && signalled=(--signalled)
# jobctl prints done | requeue | stop <code>; a deterministic verdict (config/layout/data error, divergence,
# repeated crash, corrupted replicas: <run>/verdicts) stops with its message on stderr and its exit code.
decision=$("$LMFORGE_PYTHON" -m lmforge.launch.jobctl after --exit-code "$rc" "${signalled[@]}" -- "$@")
read -r action code <<< "$decision"
case "$action" in
  done) exit 0 ;;
  requeue) sleep 5; exit 0 ;;  # normally not reached: `scontrol requeue` already ended this script
  stop) exit "${code:-1}" ;;
  *) exit "$(( rc == 0 ? 1 : rc ))" ;;
esac

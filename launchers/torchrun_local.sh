#!/bin/bash
# lmforge training on this machine: N worker processes under torchrun, with the Slurm scripts' retry contract.
#
#   launchers/torchrun_local.sh --nproc 2 -- +exp=smoke parallelism=ddp train.micro_batch_size=8
#   launchers/torchrun_local.sh --dry-run -- +exp=smoke        # print the torchrun command, start nothing
#   lmforge launch --nproc 2 +exp=smoke ...                     # this script, relaunched after a crash
#                                                               # within cluster.max_requeues
# Options (before the Hydra overrides; `--` ends them):
#   --nproc N          worker processes (default: cluster.gpus_per_node)
#   --max-restarts R   torchrun restarts of the worker group after a crash or hang (default: fault.max_restarts)
#   --rdzv-id ID       the run's id: its run directory is runs/torchrun-ID unless run.name is set (default: new)
#   --port P           the rendezvous port on 127.0.0.1 (default: a free one)
#   --dry-run          print the command instead of running it
#
# The same contract as slurm/agent.sh (docs/launching.md): torchrun is python -m lmforge.launch.agent, which
# restarts a crashed or hung group up to R times but never after a deterministic verdict (config, layout or
# data error, divergence, repeated crash, corrupted replicas; <run>/verdicts), and exits with the verdict's
# code: 2, 45, 46, 47; otherwise the first failed worker's (1 crash, 43 watchdog, 44 orphan, 42 preempted).
# Bad input (a missing value, a flag that is not a number, a config error) exits 2 with one line, before
# any worker starts.
set -euo pipefail
LMFORGE_SCRIPT=torchrun_local.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

nproc= max_restarts= rdzv_id= port=
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc|--max-restarts|--rdzv-id|--port)
      [ $# -ge 2 ] || lmforge_die "$1 needs a value. Fix: $1 VALUE"
      case "$1" in
        --nproc) lmforge_need_int "$1" "$2"; nproc=$2 ;;
        --max-restarts) lmforge_need_int "$1" "$2"; max_restarts=$2 ;;
        --port) lmforge_need_int "$1" "$2"; port=$2 ;;
        --rdzv-id) rdzv_id=$2 ;;
      esac
      shift 2 ;;
    --dry-run) lmforge_dry_run=1; shift ;;
    --) shift; break ;;
    -*) lmforge_die "unknown option $1. Fix: see the options at the top of launchers/torchrun_local.sh" ;;
    *) break ;;
  esac
done
[ "$nproc" != 0 ] || lmforge_die "--nproc must be at least 1, got 0. Fix: e.g. --nproc 2"

lmforge_prepare --nnodes 1 --node-rank 0 ${nproc:+--nproc "$nproc"} ${max_restarts:+--max-restarts "$max_restarts"} \
  ${rdzv_id:+--rdzv-id "$rdzv_id"} ${port:+--port "$port"} -- "$@"
lmforge_exec_agent 1 "$LMFORGE_NPROC_PER_NODE" "127.0.0.1:$LMFORGE_RDZV_PORT" "$LMFORGE_RDZV_ID" \
  "$LMFORGE_MAX_RESTARTS" -- "$@"

#!/bin/bash
# One torchrun agent per node, started by `srun` from train.sh. Not submitted on its own.
#
# USR1 is ignored here (and so in torchrun, which inherits the disposition); the batch script delivers the
# job's USR1 to the training workers, which install their own handler (lmforge.fault.signals). A torchrun
# agent that received USR1 itself would die and take its workers with it before they could checkpoint.
set -euo pipefail
source "${LMFORGE_REPO:?}/slurm/env.sh"
trap '' USR1
local_addr=$(lmforge_node_addr "${SLURMD_NODENAME:-$(hostname)}")
# lmforge.launch.agent is torchrun that reads the workers' verdicts ($LMFORGE_RUN_DIR/verdicts) before a
# restart: a deterministic failure (config/layout/data error, divergence, repeated crash, corrupted
# replicas) is not restarted.
# The command line is launchers/common.sh's, shared with launchers/torchrun_*.sh.
lmforge_exec_agent "$SLURM_NNODES" "$LMFORGE_NPROC_PER_NODE" "$MASTER_ADDR:$MASTER_PORT" "$SLURM_JOB_ID" \
  "$LMFORGE_MAX_RESTARTS" --local_addr="$local_addr" -- "$@"

#!/bin/bash
# A torchft run on Slurm (fault.replica_ft=torchft): the Lighthouse and every replica group as Slurm jobs, a group
# whose job fails resubmitted without the node at fault (python -m lmforge.launch.replica_ft_slurm;
# docs/fault-tolerance.md). Run it where sbatch works (a login node, in tmux), not through sbatch:
#
#   slurm/torchft_supervisor.sh --replicas 3 --name ft-demo -- +exp=gpt_1b
#   slurm/torchft_supervisor.sh --replicas 3 --dry-run -- +exp=gpt_1b   # print the sbatch commands, submit nothing
# Options (before the Hydra overrides; `--` ends them):
#   --replicas N             replica groups, one Slurm job each running slurm/train.sh (required)
#   --min-replicas M         a step commits with at least M groups (default: a majority, N // 2 + 1; fewer is
#                            refused: two disjoint quorums could commit the same step)
#   --nodes-per-group K      nodes of each group's job (default 1)
#   --max-resubmits R        resubmissions of each group (default 3; never after exit 2 or a scancel)
#   --name NAME              the run: <run.root>/NAME/replica-<i> per group, NAME/replica_ft/ the record and logs
#   --port P                 the Lighthouse's port (default 29510)
#   --lighthouse-node NODE   run the Lighthouse there (default: Slurm's choice); no group uses its node
#   --exclude NODES          nodes no job may use
#   --sbatch-arg ARG         an sbatch option for every group's job (repeat it: --sbatch-arg=--time=48:00:00)
#   --join-timeout-ms, --heartbeat-timeout-ms   the Lighthouse's (defaults 30000, 5000)
#   --poll-s S               seconds between two reads of the jobs' states (default 2)
# Needs N x K + 1 usable nodes (exit 2 before submitting otherwise). SIGTERM or SIGINT (Ctrl-C) cancels every job;
# if the supervisor dies otherwise, its jobs run on unsupervised (scancel --name=NAME-lighthouse, NAME-r<i>).
set -euo pipefail
LMFORGE_SCRIPT=torchft_supervisor.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launchers/common.sh"
exec "$LMFORGE_PYTHON" -m lmforge.launch.replica_ft_slurm "$@"

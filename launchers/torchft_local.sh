#!/bin/bash
# A torchft job on this machine (fault.replica_ft=torchft): the Lighthouse plus N replica groups of one process or K
# torchrun ranks each (DDP, FSDP or TP inside a group), a group that dies restarted to heal from a healthy peer
# (python -m lmforge.launch.replica_ft; docs/fault-tolerance.md).
#
#   launchers/torchft_local.sh --replicas 3 --name ft-demo -- model=tiny train.max_steps=50
#   launchers/torchft_local.sh --replicas 2 --nproc-per-group 2 --name ft-fsdp -- model=tiny parallelism=fsdp
#   launchers/torchft_local.sh --replicas 3 --dry-run -- model=tiny   # print the commands, start nothing
# Options (before the Hydra overrides; `--` ends them):
#   --replicas N             replica groups (required)
#   --nproc-per-group K      ranks of each group (default 1: one process; K > 1: one torchrun launch of K ranks,
#                            with a layout of K ranks in the overrides: parallelism=fsdp, ddp, tp2_sp, tp2_dp2...)
#   --group-port P           group i's torchrun rendezvous port is P + i (default: --port + 1);
#                            0: a port free at each start
#   --min-replicas M         a step commits with at least M groups (default: a majority, N // 2 + 1;
#                            fewer is refused: two disjoint quorums could commit the same step)
#   --max-restarts R         restarts of each group (default 3; never after exit 2, a config error)
#   --restart-delay-s S      wait S seconds before restarting a group (default 0)
#   --name NAME              the run: <run.root>/NAME/replica-<i> per group, NAME/replica_ft/ the launcher's logs
#   --port P                 the Lighthouse's port on 127.0.0.1 (default 29510)
#   --join-timeout-ms, --heartbeat-timeout-ms   the Lighthouse's (defaults 30000, 2000): a quorum waits up to the
#                            first for every live group (keep it above a step's time); a silent group is dead after
#                            the second
set -euo pipefail
LMFORGE_SCRIPT=torchft_local.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$LMFORGE_PYTHON" -m lmforge.launch.replica_ft "$@"

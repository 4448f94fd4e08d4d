#!/bin/bash
# lmforge training on several machines without Slurm: run this once on every node (ssh, pdsh, a Kubernetes
# pod per node, ...) with the same --nnodes, --rdzv-endpoint and --rdzv-id and each node's own --node-rank.
#
#   # on node 0 (10.0.0.1) and on node 1, the same line but --node-rank 1:
#   launchers/torchrun_multinode.sh --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id run7 \
#       --nproc 8 -- +exp=gpt_1b cluster.nodes=2
#   pdsh -w node[0-1] 'cd /shared/lmforge && launchers/torchrun_multinode.sh --nnodes 2 \
#       --node-rank %n --rdzv-endpoint node0:29400 --rdzv-id run7 -- +exp=gpt_1b cluster.nodes=2'
#
# Options (before the Hydra overrides; `--` ends them):
#   --nnodes N              nodes in the run (required)
#   --node-rank K           this node, 0..N-1 (required): node 0 hosts the rendezvous store at the endpoint,
#                           prepares the run directory (moves old verdicts to history, builds data indices)
#   --rdzv-endpoint H:P     node 0's address and a free port there, reachable from every node (required)
#   --rdzv-id ID            the run's id, the same on every node (required): run directory runs/torchrun-ID
#                           unless run.name is set; every node must see the same run directory (shared disk)
#   --nproc P               workers on this node (default: cluster.gpus_per_node)
#   --max-restarts R        torchrun restarts after a crash or hang (default: fault.max_restarts)
#   --local-addr ADDR       the address other nodes reach this node at (default: torchrun's guess, its FQDN)
#   --dry-run               print the command instead of running it
#
# Retry contract: that of slurm/agent.sh and launchers/torchrun_local.sh (docs/launching.md): a crashed or
# hung group restarts on every node up to R times, a deterministic verdict stops every node with its exit
# code (2, 45, 46, 47). Relaunching the whole run after torchrun gives up is the scheduler's job here
# (Slurm's requeue: slurm/train.sh); rerun the same lines and the run resumes from its newest checkpoint.
set -euo pipefail
LMFORGE_SCRIPT=torchrun_multinode.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

nnodes= node_rank= endpoint= rdzv_id= nproc= max_restarts= local_addr=
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes|--node-rank|--rdzv-endpoint|--rdzv-id|--nproc|--max-restarts|--local-addr)
      [ $# -ge 2 ] || lmforge_die "$1 needs a value. Fix: $1 VALUE"
      case "$1" in
        --nnodes) lmforge_need_int "$1" "$2"; nnodes=$2 ;;
        --node-rank) lmforge_need_int "$1" "$2"; node_rank=$2 ;;
        --nproc) lmforge_need_int "$1" "$2"; nproc=$2 ;;
        --max-restarts) lmforge_need_int "$1" "$2"; max_restarts=$2 ;;
        --rdzv-endpoint) endpoint=$2 ;;
        --rdzv-id) rdzv_id=$2 ;;
        --local-addr) local_addr=$2 ;;
      esac
      shift 2 ;;
    --dry-run) lmforge_dry_run=1; shift ;;
    --) shift; break ;;
    -*) lmforge_die "unknown option $1. Fix: see the options at the top of launchers/torchrun_multinode.sh" ;;
    *) break ;;
  esac
done
for need in nnodes node_rank endpoint rdzv_id; do
  [ -n "${!need}" ] || lmforge_die "--${need//_/-} is required (the same --nnodes, --rdzv-endpoint and --rdzv-id on every node, each node its own --node-rank). Fix: see launchers/torchrun_multinode.sh"
done
[ "$nnodes" -ge 1 ] || lmforge_die "--nnodes must be at least 1, got $nnodes"
[ "$node_rank" -lt "$nnodes" ] || lmforge_die "--node-rank $node_rank is not below --nnodes $nnodes. Fix: number the nodes 0..$(( nnodes - 1 ))"
[ "$nproc" != 0 ] || lmforge_die "--nproc must be at least 1, got 0. Fix: e.g. --nproc 8"
[[ "$endpoint" =~ ^.+:[0-9]+$ ]] || lmforge_die "--rdzv-endpoint must be HOST:PORT, got '$endpoint'. Fix: e.g. --rdzv-endpoint node0:29400"
lmforge_prepare --nnodes "$nnodes" --node-rank "$node_rank" ${nproc:+--nproc "$nproc"} \
  ${max_restarts:+--max-restarts "$max_restarts"} --rdzv-id "$rdzv_id" -- "$@"
host_flag=--rdzv_conf=is_host=0
[ "$node_rank" = 0 ] && host_flag=--rdzv_conf=is_host=1   # node 0 serves the rendezvous store, the others join
lmforge_exec_agent "$nnodes" "$LMFORGE_NPROC_PER_NODE" "$endpoint" "$rdzv_id" "$LMFORGE_MAX_RESTARTS" \
  "$host_flag" ${local_addr:+--local_addr="$local_addr"} -- "$@"

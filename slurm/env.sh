# Shared environment for lmforge's Slurm scripts (sourced by train.sh, agent.sh, sweep_array.sh and
# sweep_worker.sh); the part every launcher shares is launchers/common.sh, sourced here.
#
#   LMFORGE_REPO    the lmforge checkout (default: the submit directory)
#   LMFORGE_PYTHON  the Python with lmforge installed (default: $LMFORGE_REPO/.venv/bin/python, else python3)
#
# Functions:
#   lmforge_node_addr NODE   the address other nodes reach NODE at: its NodeAddr from `scontrol show node`
#                            (NodeAddr defaults to the node name on a cluster whose node names resolve; on
#                            test clusters the names may not resolve, so the NodeAddr is authoritative)
#   lmforge_head_node        the first node of the job's allocation
#   lmforge_is_loopback ADDR succeeds (printing why) when ADDR is this host's own loopback: localhost, ::1, or an
#                            address inside a prefix of lo (127.0.0.1/8 normally, so Debian's 127.0.1.1 hostname
#                            line too); a 127.x address on a real interface is another host (lmforge.launch.head_addr)
#   lmforge_master_port      a port derived from the job id and the restart count (a requeued run never
#                            trips over the previous run's socket)

LMFORGE_REPO=${LMFORGE_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
# The Python, PYTHONUNBUFFERED, TORCH_DISABLE_SHARE_RDZV_TCP_STORE and the torchrun command line
# (lmforge_exec_agent) are those of every lmforge launcher.
source "$LMFORGE_REPO/launchers/common.sh"

lmforge_head_node() {
  scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm job}" | head -n1
}

lmforge_node_addr() {
  local node=$1 addr
  addr=$(scontrol show node "$node" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2)
  echo "${addr:-$node}"
}

lmforge_master_port() {
  local job=${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:-0}} task=${SLURM_ARRAY_TASK_ID:-0} restart=${SLURM_RESTART_COUNT:-0}
  echo $(( 20000 + (job * 131 + task * 17 + restart * 7) % 20000 ))
}

lmforge_is_loopback() {
  "$LMFORGE_PYTHON" -m lmforge.launch.head_addr "$1"
}

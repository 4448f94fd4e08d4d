# Shared by every lmforge launch script: launchers/torchrun_local.sh, launchers/torchrun_multinode.sh and,
# through slurm/env.sh, the Slurm scripts. Sourced, never run.
#
#   LMFORGE_REPO    the lmforge checkout (default: the checkout this file is in)
#   LMFORGE_PYTHON  the Python with lmforge installed (default: $LMFORGE_REPO/.venv/bin/python, else python3)
#
# Functions:
#   lmforge_die MESSAGE            one line on stderr, exit 2 (bad input: no worker was started)
#   lmforge_need_int FLAG VALUE    lmforge_die unless VALUE is a whole number >= 0
#   lmforge_prepare ARGS -- OVERRIDES
#                                  python -m lmforge.launch.local prepare: validate the config for this world,
#                                  then export LMFORGE_RUN_DIR, LMFORGE_NPROC_PER_NODE, LMFORGE_MAX_RESTARTS,
#                                  OMP_NUM_THREADS (train.threads, else this machine's CPUs / processes per node:
#                                  what each worker pins; torchrun then prints no OMP_NUM_THREADS banner) and
#                                  the comm preset's environment (exit 2 with its one line when it cannot run)
#   lmforge_exec_agent NNODES NPROC ENDPOINT RDZV_ID MAX_RESTARTS [torchrun option...] -- OVERRIDES
#                                  the one torchrun command line: python -m lmforge.launch.agent (torchrun that
#                                  does not restart after a deterministic verdict) -m lmforge.train OVERRIDES.
#                                  With lmforge_dry_run=1 (a script's --dry-run) it prints the command (and the
#                                  environment it needs) instead of running it.

LMFORGE_REPO=${LMFORGE_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [ -z "${LMFORGE_PYTHON:-}" ]; then
  if [ -x "$LMFORGE_REPO/.venv/bin/python" ]; then LMFORGE_PYTHON="$LMFORGE_REPO/.venv/bin/python"
  else LMFORGE_PYTHON=python3; fi
fi
export LMFORGE_REPO LMFORGE_PYTHON
export PYTHONUNBUFFERED=1
# Elastic restarts on CPU/gloo fail intermittently with the shared rendezvous store (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
lmforge_dry_run=0

lmforge_die() {
  echo "${LMFORGE_SCRIPT:-lmforge}: $*" >&2
  exit 2
}

lmforge_need_int() {
  case "$2" in
    ''|*[!0-9]*) lmforge_die "$1 must be a whole number, got '${2}'. Fix: e.g. $1 2" ;;
  esac
}

lmforge_prepare() {
  local prep
  local dry=()
  [ "$lmforge_dry_run" = 1 ] && dry=(--dry-run)
  prep=$("$LMFORGE_PYTHON" -m lmforge.launch.local prepare "${dry[@]}" "$@") || exit $?
  eval "$prep"
}

lmforge_exec_agent() {
  local nnodes=$1 nproc=$2 endpoint=$3 rdzv_id=$4 max_restarts=$5
  shift 5
  local extra=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do extra+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  local cmd=("$LMFORGE_PYTHON" -m lmforge.launch.agent
    --nnodes="$nnodes" --nproc_per_node="$nproc"
    --rdzv_backend=c10d --rdzv_endpoint="$endpoint" --rdzv_id="$rdzv_id"
    "${extra[@]}" --max_restarts="$max_restarts"
    -m lmforge.train "$@")
  if [ "$lmforge_dry_run" = 1 ]; then
    printf 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 LMFORGE_RUN_DIR=%q OMP_NUM_THREADS=%q' "${LMFORGE_RUN_DIR:-}" \
      "${OMP_NUM_THREADS:-}"
    printf ' %q' "${cmd[@]}"
    printf '\n'
    exit 0
  fi
  exec "${cmd[@]}"
}

"""The process environment lmforge reads: one table of the variables, each with its meaning, and the accessors.

Every environment read in lmforge goes through this module (``tests/unit/test_layering.py`` checks that no
module outside ``runtime/`` reads ``os.environ``): a named accessor for the variables the code decides on
(``local_rank()``, ``slurm_job_id()``, ...), :func:`read` / :func:`read_int` for the rest, :func:`environment`
for functions that take an environment mapping (tests pass their own), :func:`matching` for families recorded by
prefix. A name missing from :data:`VARIABLES` (or a :data:`FAMILIES` prefix) is a programming error
(:class:`UnlistedVariable`): add it to the table with its meaning.

Not reads, so allowed anywhere: writing a variable (``os.environ[k] = v``, ``setdefault``, ``pop``) and copying
the whole environment for a child process (``dict(os.environ)``, ``{**os.environ, ...}``, ``os.environ.copy()``):
the child inherits it, lmforge interprets nothing in it. Inside ``runtime/``, ``secrets.py`` scans every value
for secrets (redaction only) and ``provenance.py`` records launcher variables into provenance.json.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Dict, Iterable, Iterator, Optional

VARIABLES: Dict[str, str] = {
    # the launcher's process layout (torchrun, srun via slurm/agent.sh, the test harness)
    "RANK": "global rank of this process",
    "WORLD_SIZE": "number of processes the launcher started (the layout is checked against it)",
    "LOCAL_RANK": "rank of this process on its node (picks the GPU)",
    "LOCAL_WORLD_SIZE": "processes on this node (threads per process, the device contract)",
    "MASTER_ADDR": "rendezvous address (recorded in comm_env.json)",
    "MASTER_PORT": "rendezvous port (recorded in comm_env.json)",
    "TORCHELASTIC_RUN_ID": "set by torchrun: the run id; a preemption exits 0 under torchrun, the run dir's name",
    "TORCHELASTIC_RESTART_COUNT": "torchrun's restart count of the worker group (verdicts, events, dumps)",
    "TORCHFT_LIGHTHOUSE": "the torchft Lighthouse's address when fault.lighthouse is unset (fault.replica_ft=torchft)",
    # Slurm
    "SLURM_JOB_ID": "the Slurm job (run id, dumps, requeue records)",
    "SLURM_ARRAY_JOB_ID": "the Slurm array job (a sweep point's run id)",
    "SLURM_ARRAY_TASK_ID": "this array task (a sweep point's run id, the prepare array's shard task)",
    "SLURM_ARRAY_TASK_COUNT": "tasks of the array (the prepare array's shard split)",
    "SLURM_STEP_ID": "set inside an srun step (with TORCHELASTIC_RUN_ID: a launcher watches this worker)",
    "SLURM_RESTART_COUNT": "how often Slurm requeued the job (restart events, verdicts)",
    "SLURM_JOB_NODELIST": "the job's nodes (requeue records, node exclusion)",
    "SLURM_JOB_NUM_NODES": "the job's node count",
    "SLURM_NNODES": "the job's node count (cluster.nodes from the allocation)",
    "SLURM_GPUS_ON_NODE": "GPUs Slurm allocated on this node (the device contract)",
    "SLURM_CPUS_PER_TASK": "CPUs per task of the allocation (checked against the config)",
    "SLURM_CPUS_ON_NODE": "CPUs on this node of the allocation (checked against the config)",
    "SLURMD_NODENAME": "this node's Slurm name (error lines)",
    # devices and libraries
    "CUDA_VISIBLE_DEVICES": "GPUs visible to this process (the device contract)",
    "TIKTOKEN_CACHE_DIR": "directory of cached tiktoken files (lmforge never downloads)",
    "TORCH_FORCE_WEIGHTS_ONLY_LOAD": "torch.load's weights-only switch (saved and restored around safe loads)",
    "WANDB_API_KEY": "W&B API key (online mode needs it or a .netrc entry)",
    "WANDB_BASE_URL": "W&B server (probed before online logging)",
    "WANDB_MODE": "W&B's own mode switch: logging.wandb.mode=auto follows it when set (the test suite sets disabled)",
    "WANDB_IDENTITY_TOKEN_FILE": "W&B identity token file (counts as credentials for logging.wandb.mode=auto)",
    "WANDB_CONFIG_DIR": "W&B's settings directory (its settings file may hold an api_key)",
    "NETRC": "the .netrc file holding a W&B key",
    "HOME": "the user's home (the default .netrc)",
    # lmforge's own
    "LMFORGE_RUN_DIR": "the run directory a launcher watches for verdicts (set by slurm/train.sh, lmforge launch)",
    "LMFORGE_JOB_OVERRIDES": "what slurm/train.sh appends to a job's overrides (jobctl prepare: cluster.nodes, run.name)",
    "LMFORGE_RUN_ID": "the run id chosen for this run (set by rundir.resolve_run_dir, read by its children)",
    "LMFORGE_CONF_DIR": "the conf/ tree (default: the checkout's)",
    "LMFORGE_REPO": "the lmforge checkout (Slurm scripts)",
    "LMFORGE_DATA_CACHE": "prepared-data cache (tokenizers, shards) when data.cache_dir is unset",
    "LMFORGE_CORPORA": "prepared corpora: where `lmforge data debian` writes, and data=corpus reads pretrain/",
    "LMFORGE_CACHE": "lmforge's own cache (the measured CPU GEMM peak)",
    "LMFORGE_SCALING_WANDB": "default W&B mode of `lmforge scaling`",
}

# Families read by prefix, only to record them (comm_env.json): their values are never interpreted.
FAMILIES: Dict[str, str] = {
    "NCCL_": "NCCL settings",
    "TORCH_NCCL_": "torch's NCCL settings",
    "TORCH_FR_": "torch's flight recorder settings",
    "TORCH_DISTRIBUTED_": "torch.distributed settings",
    "GLOO_": "gloo settings",
    "UCX_": "UCX transport settings",
    "FI_": "libfabric settings",
}


class UnlistedVariable(KeyError):
    """lmforge asked for an environment variable its table does not list (a programming error)."""


def _listed(name: str) -> str:
    if name not in VARIABLES and not name.startswith(tuple(FAMILIES)):
        raise UnlistedVariable(
            f"environment variable {name} is not in lmforge.runtime.env_vars.VARIABLES; add it with its meaning"
        )
    return name


# ---- generic reads ---------------------------------------------------------------------------------------
def read(name: str, default: Optional[str] = None) -> Optional[str]:
    """The value of listed variable ``name`` (an empty value stays ''), else ``default``."""
    return os.environ.get(_listed(name), default)


def read_int(name: str, default: Optional[int] = None) -> Optional[int]:
    """Listed variable ``name`` as an integer; ``default`` when unset or empty. A non-integer is a ValueError
    naming the variable."""
    raw = read(name)
    if raw is None or not raw.strip():
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def is_set(name: str) -> bool:
    return _listed(name) in os.environ


def matching(prefixes: Iterable[str]) -> Dict[str, str]:
    """Every set variable whose name starts with one of ``prefixes`` (each a listed name or a family)."""
    prefixes = tuple(_listed(p) if p not in FAMILIES else p for p in prefixes)
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def already_set(names: Iterable[str]) -> Dict[str, str]:
    """The values of those of ``names`` the user already set. The one read of names not in the table: the comm
    preset's variables are named by the config (``comm.env``, checked by config/comm_checks.py), and a value set
    in the environment wins over the preset's."""
    return {n: os.environ[n] for n in names if n in os.environ}


class _Environment(Mapping):
    """A read-only view of the process environment that refuses unlisted names (see :func:`environment`)."""

    def __getitem__(self, name: str) -> str:
        return os.environ[_listed(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _listed(name) in os.environ

    def __iter__(self) -> Iterator[str]:
        return (k for k in list(os.environ) if k in VARIABLES or k.startswith(tuple(FAMILIES)))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def environment() -> Mapping[str, str]:
    """The real environment for a function that takes an environment mapping (tests pass a dict instead)."""
    return _Environment()


# ---- named accessors -------------------------------------------------------------------------------------
def local_rank() -> int:
    return read_int("LOCAL_RANK", 0)


def launch_rank() -> int:
    """RANK as the launcher set it (before any process group); 0 for a process no launcher started."""
    return read_int("RANK", 0)


def local_world_size() -> int:
    return read_int("LOCAL_WORLD_SIZE", 1)


def launch_world_size() -> Optional[int]:
    """WORLD_SIZE as the launcher set it; None when no launcher did."""
    return read_int("WORLD_SIZE")


def launched() -> bool:
    """A launcher (torchrun, srun, the test harness) started this process as one rank of a job."""
    return is_set("RANK") and is_set("WORLD_SIZE")


def slurm_job_id() -> Optional[str]:
    return read("SLURM_JOB_ID")


def _count(name: str) -> int:
    """A restart count: 0 when unset or not a number (a count is advice, never a reason to fail)."""
    try:
        return read_int(name, 0)
    except ValueError:
        return 0


def torchrun_restart_count() -> int:
    return _count("TORCHELASTIC_RESTART_COUNT")


def slurm_restart_count() -> int:
    return _count("SLURM_RESTART_COUNT")


def under_torchrun() -> bool:
    """torchrun's elastic agent started this process (it sets TORCHELASTIC_RUN_ID; 'none' outside an agent)."""
    rid = read("TORCHELASTIC_RUN_ID")
    return bool(rid) and rid != "none"


def watched_by_launcher() -> bool:
    """A torchrun agent or an srun step runs this process (the watchdog's orphan check applies)."""
    return is_set("TORCHELASTIC_RUN_ID") or is_set("SLURM_STEP_ID")

"""What a Slurm job needs (from the cluster config) and whether the allocation it got provides it.

    needs = resources(cfg)                   # GPUs per node, CPUs per task, exclusive: the sbatch flags
    nodes_override(overrides, os.environ)    # the job's SLURM_NNODES as cluster.nodes (one source of truth)
    run_name_override(overrides, os.environ, cfg.run.name)   # a job's own run directory unless one is named
    check_allocation(cfg, os.environ)        # refuse an allocation short of what the config needs

``lmforge launch --slurm`` turns :func:`resources` into ``--gpus-per-node/--cpus-per-task/--exclusive``;
slurm/train.sh's prepare step (``jobctl prepare``) runs the other two with the job's real environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

from lmforge.config.errors import ConfigError
from lmforge.runtime.device_contract import gpu_reason

NODES_KEY = re.compile(r"^\+{0,2}cluster\.nodes=(.*)$")
RUN_NAME_KEY = re.compile(r"^\+{0,2}run\.name=(.*)$")


@dataclass(frozen=True)
class Resources:
    nodes: int
    gpus_per_node: int  # 0: the job asks Slurm for no GPUs (CPU processes)
    cpus_per_task: int  # per torchrun agent = per node (one task per node)
    exclusive: bool

    def sbatch_args(self) -> List[str]:
        args = [f"--cpus-per-task={self.cpus_per_task}"]
        if self.gpus_per_node:
            args.insert(0, f"--gpus-per-node={self.gpus_per_node}")
        if self.exclusive:
            args.append("--exclusive")
        return args


def cpus_needed(cfg) -> int:
    """CPUs per node: cluster.cpus_per_task, else one per worker times its intra-op threads (at least 1)."""
    c = cfg.cluster
    return c.cpus_per_task if c.cpus_per_task > 0 else c.gpus_per_node * max(1, cfg.train.threads)


def resources(cfg, nodes: Optional[int] = None) -> Resources:
    c = cfg.cluster
    wants_gpus = gpu_reason(cfg.train.device, c.name, c.device, {}) is not None
    return Resources(nodes or c.nodes, c.gpus_per_node if wants_gpus else 0, cpus_needed(cfg), c.exclusive)


def job_nodes(env: Mapping[str, str]) -> Optional[int]:
    raw = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    return int(raw) if raw and raw.isdigit() else None


def explicit_nodes(overrides: Sequence[str]) -> Optional[str]:
    """The value of the last ``cluster.nodes=`` override on the command line (None: not given)."""
    hits = [m.group(1) for m in map(NODES_KEY.match, overrides) if m]
    return hits[-1] if hits else None


def nodes_override(overrides: Sequence[str], env: Mapping[str, str]) -> Optional[str]:
    """``cluster.nodes=<SLURM_NNODES>`` to add to the job's overrides (None: nothing to add).

    Raises ConfigError when an explicit ``cluster.nodes`` disagrees with the allocation's node count."""
    nnodes = job_nodes(env)
    if nnodes is None:
        return None
    given = explicit_nodes(overrides)
    if given is None:
        return f"cluster.nodes={nnodes}"
    if given.strip() != str(nnodes):
        raise ConfigError(
            "cluster.nodes",
            f"is {given} on the command line but the job has {nnodes} nodes (SLURM_NNODES)",
            f"drop cluster.nodes={given} (the allocation's node count is used) or submit with sbatch --nodes={given}",
        )
    return None


def check_allocation(cfg, env: Mapping[str, str]) -> None:
    """Refuse an allocation with fewer GPUs or CPUs per node than the config needs (one line naming both)."""
    c = cfg.cluster
    gpus = env.get("SLURM_GPUS_ON_NODE", "").strip()
    wants = gpu_reason(cfg.train.device, c.name, c.device, env)
    if wants and gpus.isdigit() and int(gpus) < c.gpus_per_node:
        raise ConfigError(
            "cluster.gpus_per_node",
            f"is {c.gpus_per_node} but the allocation has {gpus} GPU(s) on this node (SLURM_GPUS_ON_NODE)",
            f"submit with --gpus-per-node={c.gpus_per_node} "
            f"(lmforge launch --slurm does) or set cluster.gpus_per_node={gpus}",
        )
    cpus = (env.get("SLURM_CPUS_PER_TASK") or env.get("SLURM_CPUS_ON_NODE") or "").strip()
    need = cpus_needed(cfg)
    if cpus.isdigit() and int(cpus) < need:
        source = "SLURM_CPUS_PER_TASK" if env.get("SLURM_CPUS_PER_TASK") else "SLURM_CPUS_ON_NODE"
        key = "cluster.cpus_per_task" if c.cpus_per_task > 0 else "cluster.gpus_per_node"
        why = (
            f"cluster.cpus_per_task={need}"
            if c.cpus_per_task > 0
            else f"{c.gpus_per_node} worker(s) x {max(1, cfg.train.threads)} thread(s)"
        )
        raise ConfigError(
            key,
            f"needs {need} CPU(s) per node ({why}) but the allocation has {cpus} ({source})",
            f"submit with --cpus-per-task={need} (lmforge launch --slurm does)",
        )


def run_name_override(overrides: Sequence[str], env: Mapping[str, str], composed_name: Optional[str]) -> Optional[str]:
    """``run.name=null`` for a Slurm job whose run name comes from a preset (``+exp=smoke`` sets ``run.name=smoke``)
    rather than its command line, so the job writes its own ``<run.root>/slurm-<jobid>`` (kept across requeues)
    instead of resuming, or sharing with another job, the directory of a local run of that preset. None: nothing
    to add (not a Slurm job, no name, or the name given on the command line: that run is the user's choice)."""
    if not env.get("SLURM_JOB_ID") or composed_name in (None, "", "null", "None"):
        return None
    if any(RUN_NAME_KEY.match(o) for o in overrides):
        return None
    return "run.name=null"

"""Schema of the ``cluster`` config group (``conf/cluster/*.yaml``): the hardware a run is planned for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from lmforge.config.ranges import NonNegativeInt, PositiveInt, Range


@dataclass
class ClusterConfig:
    name: str = "local"
    """The preset's name (a conf/cluster file name)."""
    nodes: PositiveInt = 1
    """Nodes of the job (under Slurm: the allocation's SLURM_NNODES)."""
    gpus_per_node: PositiveInt = 1
    """Devices (GPUs, or CPU processes) per node."""
    device: str = "auto"
    """Device kind for planning: auto, cpu, h100, h200, a100, ... (runtime/hardware.py); a GPU kind makes the job
    want GPUs (the device contract)."""
    device_memory_gib: float = 0.0
    """Memory per device in GiB for the planner; 0 = from the hardware table."""
    assumed_mfu: Annotated[float, Range(0, 1, low_open=True, fix="e.g. 0.4")] = 0.40
    """Model FLOPs utilisation the planner assumes for a layout without pipeline bubble or recompute, in (0, 1]."""
    cpus_per_task: NonNegativeInt = 0
    """Slurm: CPUs per node (= per task: one torchrun agent per node); 0 = gpus_per_node x max(1, train.threads)."""
    exclusive: bool = False
    """Slurm: ask for whole nodes (sbatch --exclusive)."""
    partition: str = ""
    """Slurm partition; '' = the cluster's default."""
    account: str = ""
    """Slurm account; '' = the user's default."""
    time_limit_min: int = 60
    """Slurm time limit of one job, in minutes."""
    signal_lead_s: int = 120
    """Slurm sends the job SIGUSR1 this long before the time limit (checkpoint, exit 42, requeue)."""
    max_requeues: int = 3
    """Relaunch budget of one job (Slurm requeues, lmforge launch restarts) after preemption or a failure."""

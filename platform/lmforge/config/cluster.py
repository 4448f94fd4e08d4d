"""Schema of the ``cluster`` config group (``conf/cluster/*.yaml``): the hardware a run is planned for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClusterConfig:
    name: str = "local"
    nodes: int = 1
    # Devices (GPUs, or CPU processes) per node.
    gpus_per_node: int = 1
    # Device kind for planning: auto | cpu | h100 | h200 | a100 | ... (see lmforge.runtime.hardware).
    device: str = "auto"
    # Memory per device in GiB for the planner (0: from the hardware table).
    device_memory_gib: float = 0.0
    # Model FLOPs utilisation the planner assumes for a layout without pipeline bubble or recompute.
    assumed_mfu: float = 0.40
    # Slurm settings used by launchers/ and slurm/ (ignored by local runs).
    # CPUs per node (= per task: one torchrun agent per node); 0: gpus_per_node x max(1, train.threads).
    cpus_per_task: int = 0
    # Ask for whole nodes (sbatch --exclusive).
    exclusive: bool = False
    partition: str = ""
    account: str = ""
    time_limit_min: int = 60
    signal_lead_s: int = 120
    max_requeues: int = 3

"""Schema of the ``cluster`` config group (``conf/cluster/*.yaml``): the hardware a run is planned for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from lmforge.config.errors import ConfigError
from lmforge.config.ranges import NonNegativeFloat, NonNegativeInt, PositiveInt

Link = Annotated[
    str,
    Literal[
        "auto", "nvlink3", "nvlink4", "nvlink5", "ib_hdr", "ib_ndr", "roce_200", "roce_400", "pcie4", "xgmi", "loopback"
    ],
]


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
    assumed_mfu: float = 0.0
    """Retired (0 = unset; any other value is refused): the planner predicts step time from the work
    (parallel/step_model.py); a measured GEMM rate goes in ``gemm_tflops``."""
    gemm_tflops: NonNegativeFloat = 0.0
    """Measured large-GEMM rate per device in TFLOP/s for the planner's step model; 0 = the device table's
    (peak x its sustained share, parallel/device_table.py; on CPU the measured GEMM peak)."""
    intra_node_link: Link = "auto"
    """Link between the devices of a node for the step model; auto = the device's NVLink generation."""
    inter_node_link: Link = "auto"
    """Per-device network between nodes for the step model; auto = the device's DGX NIC (A100: ib_hdr, else ib_ndr)."""
    comm_bench: str = ""
    """A `lmforge comm bench` JSON whose measured bus bandwidth replaces the link table for its placement
    (within a node when its world fits in one, across nodes otherwise); '' = the link table."""
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
    """Slurm sends the job SIGUSR1 this long before the time limit (checkpoint, exit 42, requeue); lmforge launch
    --slurm passes it to sbatch, slurm/train.sh's #SBATCH --signal line holds the default. Keep it above a checkpoint
    save."""
    max_requeues: int = 3
    """Relaunch budget of one job (Slurm requeues, lmforge launch restarts) after preemption or a failure."""
    min_nodes: NonNegativeInt = 0
    """Slurm: a requeue that excludes nodes at fault asks for that many fewer nodes for the next run, down to this
    many, when the layout is valid at the smaller count; the layout must follow the node count (e.g.
    parallelism.dp_replicate=${cluster.nodes}: fewer data-parallel replicas, the same global batch with more
    accumulation). 0 = never: the next run waits for as many healthy nodes."""


def check_retired(cluster: ClusterConfig) -> None:
    """Refuse the retired ``cluster.assumed_mfu`` (one line naming its replacement)."""
    if cluster.assumed_mfu != 0.0:
        raise ConfigError(
            "cluster.assumed_mfu",
            "is retired: the planner predicts step time from per-op GEMM efficiency, the link table and the schedule "
            "(lmforge.parallel.step_model)",
            "remove the override; give a measured GEMM rate with cluster.gemm_tflops",
        )

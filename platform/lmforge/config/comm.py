"""Schema of the ``comm`` config group (``conf/comm/*.yaml``): collectives backend and transport environment.

Cross-field checks of this group (transport vs variables, NCCL value spellings, ...) live in
``lmforge.config.comm_checks``; docs/collectives.md explains every preset and variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, Literal


@dataclass
class CommConfig:
    name: str = "cpu_gloo"
    backend: Annotated[str, Literal["auto", "nccl", "gloo"]] = "auto"  # auto: nccl on CUDA, gloo on CPU
    # What carries traffic between nodes: auto (let NCCL probe) | infiniband | roce | socket (TCP) | local (one node).
    transport: Annotated[str, Literal["auto", "infiniband", "roce", "socket", "local"]] = "auto"
    init_timeout_s: int = 600
    collective_timeout_s: int = 600
    # TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (0 when false): on an NCCL error or timeout the watchdog ends the process
    # instead of letting the job hang.
    async_error_handling: bool = True
    flight_recorder_entries: int = 0  # TORCH_FR_BUFFER_SIZE (older torch: TORCH_NCCL_TRACE_BUFFER_SIZE); 0: unset
    dump_on_timeout: bool = False  # TORCH_NCCL_DUMP_ON_TIMEOUT (needs flight_recorder_entries > 0)
    # Environment variables exported before any process group is created (NCCL_*, GLOO_*, ...). Values must
    # be strings (or integers); a variable already set in the environment wins over the preset.
    env: Dict[str, Any] = field(default_factory=dict)
    # Run the bus-bandwidth bench before training and stop if bus bandwidth is below the floor.
    preflight: bool = False
    # Floor in GB/s (10^9 bytes/s, the nccl-tests unit) on the peak bus bandwidth of preflight_floor_ops.
    preflight_floor_gbps: float = 0.0
    preflight_floor_ops: str = "all_reduce"  # comma-separated ops the floor applies to
    preflight_max_bytes: int = 16 * 2**20  # largest message of the preflight sweep
    preflight_iters: int = 5

"""Schema of the ``comm`` config group (``conf/comm/*.yaml``): collectives backend and transport environment.

Cross-field checks of this group (transport vs variables, NCCL value spellings, ...) live in
``lmforge.config.comm_checks``; docs/collectives.md explains every preset and variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, Literal


@dataclass
class CommConfig:
    name: str = "auto"
    """The preset's name (a conf/comm file name)."""
    backend: Annotated[str, Literal["auto", "nccl", "gloo"]] = "auto"
    """Collectives backend; auto = nccl on CUDA, gloo on CPU."""
    transport: Annotated[str, Literal["auto", "infiniband", "roce", "socket", "local"]] = "auto"
    """What carries traffic between nodes: auto (NCCL probes), infiniband, roce, socket (TCP) or local (one
    node)."""
    init_timeout_s: int = 600
    """Timeout of process-group creation (rendezvous)."""
    collective_timeout_s: int = 1200
    """Timeout of one collective (the process group's timeout is the larger of it and init_timeout_s); above
    fault.watchdog_timeout_s, so the watchdog writes a hung collective's stacks before this timeout ends it."""
    async_error_handling: bool = True
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (0 when false): on an NCCL error or timeout the watchdog ends the process
    instead of letting the job hang."""
    flight_recorder_entries: int = 0
    """TORCH_FR_BUFFER_SIZE (older torch: TORCH_NCCL_TRACE_BUFFER_SIZE): collectives the flight recorder keeps;
    0 = unset."""
    dump_on_timeout: bool = False
    """TORCH_NCCL_DUMP_ON_TIMEOUT: dump the flight recorder on a timeout (needs flight_recorder_entries > 0)."""
    env: Dict[str, Any] = field(default_factory=dict)
    """Environment variables exported before any process group is created (NCCL_*, GLOO_*, ...), as strings or
    integers; a variable already set in the environment wins over the preset. Add one with +comm.env.NAME=value."""
    preflight: bool = False
    """Run the bus-bandwidth bench before training and stop if bus bandwidth is below the floor."""
    preflight_floor_gbps: float = 0.0
    """Floor in GB/s (10^9 bytes/s, the nccl-tests unit) on the peak bus bandwidth of preflight_floor_ops."""
    preflight_floor_ops: str = "all_reduce"
    """Comma-separated collectives the preflight floor applies to."""
    preflight_max_bytes: int = 16 * 2**20
    """Largest message of the preflight sweep, in bytes."""
    preflight_iters: int = 5
    """Timed iterations per message size of the preflight sweep."""

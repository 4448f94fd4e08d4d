"""Schema of the ``comm`` config group (``conf/comm/*.yaml``): collectives backend and transport environment."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class CommConfig:
    name: str = "cpu_gloo"
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    init_timeout_s: int = 600
    collective_timeout_s: int = 600
    async_error_handling: bool = True
    flight_recorder_entries: int = 0  # TORCH_NCCL_TRACE_BUFFER_SIZE; 0 disables
    dump_on_timeout: bool = True
    # Environment variables exported before any process group is created (NCCL_*, GLOO_*, ...).
    env: Dict[str, str] = field(default_factory=dict)
    # Run `lmforge comm bench` before training and fail if bus bandwidth is below the floor.
    preflight: bool = False
    preflight_floor_gbps: float = 0.0

"""Create the default process group from the environment torchrun / srun / the test harness set.

Without RANK/WORLD_SIZE (a plain ``python -m lmforge.train``) a world of one is created on a private
file store, so every code path (megatron-core's dataset builder, DCP) sees an initialised group.
The ``comm`` preset's variables are exported first (``lmforge.comm.transport_env``) and, given a run directory,
recorded by rank 0 in ``<run>/comm_env.json``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from lmforge.comm.transport_env import comm_env_record, export_comm_env, write_comm_env
from lmforge.config.comm import CommConfig
from lmforge.config.errors import ConfigError
from lmforge.runtime.env_vars import launched, local_rank, local_world_size
from lmforge.runtime.rundir import RunPaths

__all__ = ["WorldInfo", "choose_backend", "export_comm_env", "init_process_group", "destroy_process_group"]


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str


def choose_backend(cfg: CommConfig, device: torch.device) -> str:
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "comm.backend",
            f"nccl needs a CUDA device but this rank runs on '{device}' (gloo only)",
            "use comm=cpu_gloo or comm.backend=auto on CPU",
        )
    return cfg.backend


def init_process_group(cfg: CommConfig, device: torch.device, run_dir: Optional[Path] = None) -> WorldInfo:
    backend = choose_backend(cfg, device)
    paths = RunPaths(Path(run_dir)) if run_dir is not None else None
    applied = export_comm_env(cfg, paths.dumps if paths is not None else None)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=max(cfg.init_timeout_s, cfg.collective_timeout_s))
        if launched():
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        else:
            # A world of one needs no rendezvous: an in-process store (a file store left a file in /tmp per run).
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = WorldInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank(),
        local_world_size=local_world_size(),
        backend=backend,
    )
    if paths is not None and world.rank == 0:
        write_comm_env(paths.comm_env, comm_env_record(cfg, applied, backend, world.world_size))
    return world


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

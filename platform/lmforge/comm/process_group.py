"""Create the default process group from the environment torchrun / srun / the test harness set.

Without RANK/WORLD_SIZE (a plain ``python -m lmforge.train``) a world of one is created on a private
file store, so every code path (megatron-core's dataset builder, DCP) sees an initialised group.
"""
from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmforge.config.comm import CommConfig


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str


def choose_backend(cfg: CommConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def export_comm_env(cfg: CommConfig) -> None:
    """Export the preset's transport variables before any process group exists (user env wins)."""
    for key, value in cfg.env.items():
        os.environ.setdefault(str(key), str(value))
    if cfg.async_error_handling:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if cfg.flight_recorder_entries > 0:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(cfg.flight_recorder_entries))
        if cfg.dump_on_timeout:
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def init_process_group(cfg: CommConfig, device: torch.device) -> WorldInfo:
    export_comm_env(cfg)
    backend = choose_backend(cfg, device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.init_timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        else:
            store_path = tempfile.mktemp(prefix="lmforge-pg-")
            dist.init_process_group(backend=backend, init_method=f"file://{store_path}", rank=0, world_size=1,
                                    timeout=timeout)
    return WorldInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend=backend,
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

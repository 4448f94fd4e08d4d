"""``parallelize(model, mesh, cfg)``: the one place that applies parallelism, always in this order

    1. pipeline stage split      (parallel/pipeline.py)
    2. tensor + sequence parallel (parallel/tensor_parallel.py)
    3. activation checkpointing  (parallel/activation_checkpoint.py)
    4. torch.compile             (parallel/compile.py)
    5. FSDP2                     (parallel/data_parallel.py)

then ``materialize`` moves meta tensors to the device and initialises them (identically for every
layout), and DDP wraps last for pure replication. The model code itself stays single-device.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.config.parallelism import ParallelismConfig
from lmforge.parallel.activation_checkpoint import apply_activation_checkpointing
from lmforge.parallel.compile import apply_compile
from lmforge.parallel.data_parallel import apply_ddp, apply_fsdp


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelismConfig) -> nn.Module:
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    if cfg.dp_shard > 1:
        apply_fsdp(model, mesh, cfg)
    return model


def place_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full initial value into a parameter; a DTensor keeps only its own slice (no communication:
    every rank computes the same full value)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(value.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> None:
    """Allocate meta tensors on ``device`` and fill them with the name-keyed deterministic init."""
    model.to_empty(device=device)
    model.init_weights(seed, device=device, place=place_full_value)
    if dtype != torch.float32:
        model.to(dtype)


def wrap_data_parallel(model: nn.Module, mesh: DeviceMesh, cfg: ParallelismConfig) -> nn.Module:
    if cfg.dp_replicate > 1 and cfg.dp_shard == 1:
        return apply_ddp(model, mesh, cfg)
    return model

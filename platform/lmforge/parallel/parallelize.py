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

from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.config.parallelism import ParallelismConfig
from lmforge.parallel.activation_checkpoint import apply_activation_checkpointing
from lmforge.parallel.compile import apply_compile
from lmforge.parallel.data_parallel import apply_ddp, apply_fsdp
from lmforge.parallel.pipeline import StagePlan, make_shells, plan_stages, prune_to_rank, share_buffers
from lmforge.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class ParallelModel:
    """``model`` owns this rank's parameters (optimizer, checkpoints, clipping use it); ``parts`` are the
    modules whose forward runs: ``[model]``, or this rank's pipeline stages (sharing model's submodules)."""
    model: nn.Module
    parts: List[nn.Module] = field(default_factory=list)
    stage_plan: Optional[StagePlan] = None


def parallelize_parts(model: nn.Module, mesh: DeviceMesh, cfg: ParallelismConfig) -> ParallelModel:
    plan = None
    if cfg.pp > 1:
        plan = plan_stages(model.cfg.n_layers, cfg)
        prune_to_rank(model, plan, mesh["pp"].get_local_rank())
    if cfg.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], cfg.sequence_parallel)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        apply_compile(model)
    parts = make_shells(model, plan, mesh["pp"].get_local_rank()) if plan is not None else [model]
    if cfg.dp_shard > 1:
        for part in parts:
            apply_fsdp(part, mesh, cfg)
    return ParallelModel(model, parts, plan)


def place_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full initial value into a parameter; a DTensor keeps only its own slice (no communication:
    every rank computes the same full value)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def parallelize(model: nn.Module, mesh: DeviceMesh, cfg: ParallelismConfig) -> nn.Module:
    """Steps 1-5 on ``model`` in place; returns the module owning this rank's parameters."""
    return parallelize_parts(model, mesh, cfg).model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, dtype: torch.dtype = torch.float32,
                parts: Optional[List[nn.Module]] = None) -> None:
    """Allocate meta tensors on ``device`` and fill them with the name-keyed deterministic init."""
    model.to_empty(device=device)
    model.init_weights(seed, device=device, place=place_full_value)
    if dtype != torch.float32:
        model.to(dtype)
    if parts and any(part is not model for part in parts):
        share_buffers(model, parts)


def wrap_data_parallel(model: nn.Module, mesh: DeviceMesh, cfg: ParallelismConfig) -> nn.Module:
    """DDP for pure replication of an unsplit, untensor-parallel model; otherwise the model itself."""
    if uses_ddp(cfg):
        return apply_ddp(model, mesh, cfg)
    return model


def uses_ddp(cfg: ParallelismConfig) -> bool:
    return cfg.dp_replicate > 1 and cfg.dp_shard == 1 and cfg.tp == 1 and cfg.pp == 1


def uses_manual_allreduce(cfg: ParallelismConfig) -> bool:
    """Replication without FSDP where DDP is off (no overlap) or does not apply (TP / PP)."""
    return cfg.dp_replicate > 1 and cfg.dp_shard == 1 and (not cfg.overlap_grad_reduce or cfg.tp > 1 or cfg.pp > 1)

"""``parallelize(model, cfg, mesh, device)``: the one place that turns a meta-device GPT into this rank's
finished, wrapped model. Parallelism is applied in this order, each step in its own file:

    1. pipeline stage split       (parallel/pipeline.py: this rank's part by the GPT constructor)
    1b. float8 linears            (parallel/float8.py: train.precision=fp8, before any wrapping, as torchao needs)
    2. tensor + sequence parallel (parallel/tensor_parallel.py)
    2b. context parallel          (parallel/context_parallel.py: this rank's RoPE positions, the K/V exchange)
    2c. expert parallel           (parallel/expert_parallel.py: experts split over ep, all-to-all token dispatch)
    2d. residual stream dtype     (parallel/precision.py: bf16 under bf16-mixed, fp32 with train.fp32_residual)
    3. activation checkpointing   (parallel/activation_checkpoint.py)
    4. torch.compile              (parallel/compile.py)
    5. FSDP2                      (parallel/data_parallel.py; per pipeline stage; over dp_shard x cp when cp > 1;
                                   with ep > 1 the experts first, over dp_shard_mod_ep)

then the model is finished: ``materialize`` moves meta tensors to the device and initialises them by name
(identically for every layout) in the parameter dtype, tensor-parallel gradients keep their parameters'
layout, DDP wraps last for pure replication, and for pp > 1 a ``PipelineRunner`` drives the stages. The
model code itself stays single-device.

The DeepSpeed engine goes through the same function with the layout it supports (no PP/TP/FSDP, no
compile: refused at validation): activation checkpointing and materialize in fp32; DeepSpeed then owns data
parallelism and precision, so there is no DDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.config.batch import BatchPlan
from lmforge.config.parallelism import ParallelismConfig
from lmforge.config.schema import RootConfig
from lmforge.model.gpt import GPT
from lmforge.parallel.activation_checkpoint import apply_activation_checkpointing
from lmforge.parallel.compile import apply_compile
from lmforge.parallel.context_parallel import ContextLayout, apply_context_parallel
from lmforge.parallel.data_parallel import apply_ddp, apply_fsdp
from lmforge.parallel.expert_parallel import apply_expert_parallel
from lmforge.parallel.float8 import convert_to_float8
from lmforge.parallel.mesh import ParallelMesh
from lmforge.parallel.pipeline import PipelineRunner, build_stages, plan_stages, rank_part
from lmforge.parallel.precision import cast_residual_stream, residual_dtype, resolve_precision
from lmforge.parallel.tensor_parallel import apply_tensor_parallel, keep_grads_in_param_layout


@dataclass
class ParallelModel:
    """This rank's finished model.

    ``model`` owns the rank's parameters (optimizer, checkpoints, clipping use it); ``module`` is what a
    forward calls (``DDP(model)`` or ``model``); ``parts`` are the modules whose forward runs (``[model]``, or
    this rank's pipeline stages, sharing ``model``'s submodules); ``pipeline`` runs the pipeline schedule
    (pp > 1, else None); ``manual_grad_sync``: gradients are all-reduced after backward
    (``data_parallel.allreduce_gradients``) instead of by DDP/FSDP."""

    model: nn.Module
    module: nn.Module
    parts: List[nn.Module]
    pipeline: Optional[PipelineRunner]
    manual_grad_sync: bool
    context: Optional[ContextLayout] = None  # cp > 1: the sequence layout each batch is sharded by


def parallelize(
    model: GPT,
    cfg: RootConfig,
    mesh: Optional[ParallelMesh],
    device: torch.device,
    batch: Optional[BatchPlan] = None,
    fsdp: Optional[bool] = None,
) -> ParallelModel:
    """Steps 1-5 (1b: float8 linears), then materialize, the gradient layout and the wrapping, for ``model`` (on the meta device).

    ``mesh`` is None only for the DeepSpeed engine. ``batch``: validate()'s batch plan, needed for pp > 1 (a
    pipeline step runs ``parallelism.pp_microbatches``, else ``batch.grad_accum``, micro batches). ``fsdp``:
    None applies FSDP2 exactly when ``dp_shard > 1``; True also over a one-rank ``dp_shard`` dim (the GPU check's one-device FSDP2 run)."""
    p = cfg.parallelism
    if mesh is None and (p.pp > 1 or p.tp > 1 or p.dp_shard > 1 or p.cp > 1 or uses_ddp(p)):
        raise ValueError(f"parallelize: layout pp={p.pp} tp={p.tp} dp_shard={p.dp_shard} needs a device mesh")
    if p.pp > 1 and batch is None:
        raise ValueError("parallelize: pp > 1 needs validate()'s batch plan (batch=...)")
    stages = plan_stages(model.cfg.n_layers, p) if p.pp > 1 else None
    if stages is not None:
        attention = model.document_attention  # the backend of document-masked forwards carries over to the part
        with torch.device("meta"):
            model = rank_part(model.cfg, stages, mesh["pp"].get_local_rank())
        model.document_attention = attention
    fp8 = resolve_precision(cfg.train.precision, device) == "fp8"
    if fp8:
        convert_to_float8(model, cfg.train.fp8, device=device, compiled=p.compile)
    if p.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], p.sequence_parallel, float8=fp8)
    context = apply_context_parallel(model, mesh, p.cp_kv_exchange) if p.cp > 1 else None
    if p.ep > 1:
        apply_expert_parallel(model, mesh)
    residual = residual_dtype(resolve_precision(cfg.train.precision, device), cfg.train.fp32_residual)
    if residual is not None and p.engine == "native":  # DeepSpeed's bf16 mode holds bf16 weights: bf16 already
        cast_residual_stream(model, residual)
    apply_activation_checkpointing(
        model,
        p.activation_checkpointing,
        modules=p.recompute_modules,
        first_k=p.recompute_layers,
        selective_matmuls=p.selective_matmuls,
        stage_layers=None
        if stages is None
        else [stages.layers[s] for s in stages.local_stages(mesh["pp"].get_local_rank())],
    )
    if p.compile:
        apply_compile(model)
    parts = build_stages(model, stages, mesh["pp"].get_local_rank()) if stages is not None else [model]
    if uses_fsdp(p) if fsdp is None else fsdp:
        for part in parts:
            apply_fsdp(part, mesh, p)
    materialize(model, device, cfg.train.seed, parameter_dtype(cfg, device))
    if p.tp > 1:
        keep_grads_in_param_layout(model)  # vocab-parallel embedding grads: Shard(0), not the full table
    module = apply_ddp(model, mesh, p) if uses_ddp(p) else model
    pipeline = None
    if stages is not None:
        pipeline = PipelineRunner(parts, stages, mesh["pp"], device, p, p.pp_microbatches or batch.grad_accum)
    return ParallelModel(model, module, parts, pipeline, uses_manual_allreduce(p), context)


def parameter_dtype(cfg: RootConfig, device: torch.device) -> torch.dtype:
    """bf16 parameters for ``train.precision=bf16`` on the native engine; fp32 otherwise (DeepSpeed keeps fp32
    master weights and casts through its own bf16 config)."""
    native_bf16 = resolve_precision(cfg.train.precision, device) == "bf16" and cfg.parallelism.engine == "native"
    return torch.bfloat16 if native_bf16 else torch.float32


def place_full_value(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full initial value into a parameter; a DTensor keeps only its own slice (no communication:
    every rank computes the same full value)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(value.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def materialize(model: GPT, device: torch.device, seed: int, dtype: torch.dtype = torch.float32) -> None:
    """Allocate meta tensors on ``device`` and fill them with the name-keyed deterministic init."""
    model.to_empty(device=device)
    model.init_weights(seed, device=device, place=place_full_value)
    if dtype != torch.float32:
        model.to(dtype)


def uses_fsdp(cfg: ParallelismConfig) -> bool:
    """FSDP2 for dp_shard > 1, and for cp > 1 (cp ranks hold replicas: FSDP over dp_shard x cp reduces their
    gradients, the layout torchtitan uses)."""
    return cfg.dp_shard > 1 or cfg.cp > 1


def uses_ddp(cfg: ParallelismConfig) -> bool:
    """DDP for pure replication of an unsplit, untensor-parallel model on the native engine (DeepSpeed owns
    its data parallelism)."""
    return (
        cfg.engine == "native"
        and cfg.dp_replicate > 1
        and cfg.dp_shard == 1
        and cfg.tp == 1
        and cfg.pp == 1
        and cfg.cp == 1
    )


def uses_manual_allreduce(cfg: ParallelismConfig) -> bool:
    """Replication without FSDP where DDP is off (no overlap) or does not apply (TP / PP)."""
    return cfg.dp_replicate > 1 and not uses_fsdp(cfg) and (not cfg.overlap_grad_reduce or cfg.tp > 1 or cfg.pp > 1)

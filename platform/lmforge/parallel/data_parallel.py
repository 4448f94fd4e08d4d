"""Data parallelism: FSDP2 (``fully_shard``) for dp_shard > 1, DDP for pure replication.

Under gradient accumulation FSDP2 reduce-scatters after every micro batch's backward, or, with
``parallelism.fsdp_grad_sync=last_microbatch``, keeps unsharded gradients until the last micro batch
(``set_fsdp_gradient_sync``); with ``reshard_after_forward=false`` too, the parameters then stay gathered from the
step's first forward to its last backward (one all-gather and one reduce-scatter per block and step: Megatron's
distributed optimizer, the ``distributed_optimizer`` preset); DDP always defers (``no_sync``).
Gradient reduction overlaps backward by default (DDP buckets of ``ddp_bucket_cap_mb``; FSDP2 prefetches
and reduce-scatters per block). With ``overlap_grad_reduce=false`` DDP is replaced by one all-reduce of
every gradient after backward, the no-overlap baseline the overlap benchmark compares against. Pure
replication combined with TP or PP (DTensor parameters, pipeline stages) also uses that all-reduce (on
the local shards); for overlap there, use FSDP (``dp_shard``) or HSDP (both dims).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config.parallelism import ParallelismConfig
from lmforge.parallel.expert_parallel import shard_experts
from lmforge.parallel.mesh import ParallelMesh

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_fsdp(model: nn.Module, mesh: ParallelMesh, cfg: ParallelismConfig) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard = "dp_shard_cp" if cfg.cp > 1 else "dp_shard"  # cp ranks hold replicas: shard (and reduce) over them too
    dp_mesh = mesh[shard] if cfg.dp_replicate == 1 else mesh["dp_replicate", shard]
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
    if cfg.ep > 1:  # each layer's experts over the ranks holding the same experts (parallel/expert_parallel.py)
        shard_experts(model, mesh, cfg, mp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp)
    # The root holds embeddings, final norm and output; keep them gathered after forward (used at once by backward).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)


def set_fsdp_gradient_sync(parts, enabled: bool, keep_gathered: bool = False) -> None:
    """Turn FSDP2's reduce-scatter (and HSDP all-reduce) after backward on or off for every FSDP module.

    ``keep_gathered`` (``reshard_after_forward=false``): a backward that does not sync leaves the parameters
    gathered too, so the next micro batch's forward all-gathers nothing; the syncing backward reshards them."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(enabled, recurse=True)
            if keep_gathered:
                part.set_reshard_after_backward(enabled, recurse=True)


def apply_ddp(model: nn.Module, mesh: ParallelMesh, cfg: ParallelismConfig) -> nn.Module:
    if not cfg.overlap_grad_reduce:
        return model  # gradients are all-reduced after backward by allreduce_gradients()
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    return DistributedDataParallel(
        model,
        process_group=mesh["dp"].get_group(),
        bucket_cap_mb=cfg.ddp_bucket_cap_mb,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        # the buffers (RoPE tables, MoE routing biases) are equal on every dp replica and
        # change only with the parameters: synced once at wrap, never per forward
        forward_sync_buffers=False,
    )


@torch.no_grad()
def allreduce_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Average gradients over ``group`` after backward (no overlap): one flat all-reduce."""
    grads = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters() if p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat.div_(dist.get_world_size(group))
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()

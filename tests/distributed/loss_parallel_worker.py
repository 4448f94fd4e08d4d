"""Vocab-parallel cross-entropy on a real tp mesh beside the chunked loss on the whole logits (run inside
parallel_worker's launch: ``{"call": "distributed.loss_parallel_worker:compare"}``)."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lmforge.model.gpt import cross_entropy_loss
from lmforge.parallel import loss_parallel
from lmforge.parallel.loss_parallel import vocab_parallel_cross_entropy


def _case(mesh, vocab: int, dtype: torch.dtype, shift: int = 0) -> Dict[str, float]:
    """Loss and logits gradient, vocab-parallel against whole-row, on the same logits; ``shift`` offsets the
    target columns a rank believes it holds (the negative control)."""
    g = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(2, 24, vocab, generator=g)).to(dtype)  # every rank draws the same logits
    targets = torch.randint(0, vocab, (2, 24), generator=g)
    targets[0, :5] = -100  # not counted
    whole = logits.clone().requires_grad_(True)
    ref = cross_entropy_loss(whole, targets)
    (ref_grad,) = torch.autograd.grad(ref, whole)
    sharded = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_(True)
    if shift:
        start = mesh.get_local_rank() * -(-vocab // mesh.size()) + shift
        local, flat_targets = sharded.to_local().flatten(0, 1), targets.flatten(0, 1)
        loss = loss_parallel._VocabParallelCrossEntropy.apply(local, flat_targets, start, mesh.get_group())
    else:
        loss = vocab_parallel_cross_entropy(sharded, targets)
    (grad,) = torch.autograd.grad(loss, sharded)
    full_grad = grad.full_tensor()
    return {
        "loss_diff": abs(loss.item() - ref.item()),
        "grad_diff": (full_grad.float() - ref_grad.float()).abs().max().item(),
        "grad_dtype_ok": float(full_grad.dtype == dtype),
        "loss": loss.item(),
    }


def compare() -> Dict[str, Dict[str, float]]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    out = {
        "even_fp32": _case(mesh, 64, torch.float32),
        "uneven_fp32": _case(mesh, 61, torch.float32),  # torch.chunk's split: 31 + 30 columns
        "even_bf16": _case(mesh, 64, torch.bfloat16),
        "shifted_targets": _case(mesh, 64, torch.float32, shift=1),
    }
    dist.barrier()
    return out

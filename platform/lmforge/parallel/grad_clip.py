"""Global gradient-norm clipping for every layout.

The norm must be the norm of the *whole* model's gradient, the same number a single process computes:

- DTensor gradients (FSDP shards, TP shards, or both): per mesh, ``_foreach_norm`` gives DTensor norms
  whose ``full_tensor()`` reduces the shards (Replicate placements are not double counted);
- plain gradients are either unsharded (identical on the ranks that hold them: DDP after the all-reduce,
  TP-replicated norms) or pipeline-local;
- pipeline stages hold disjoint parameters: squared norms are summed over the ``pp`` group.

Every rank then scales its gradients by the same ``min(1, max_norm / (norm + 1e-6))``, the formula of
``torch.nn.utils.clip_grad_norm_``, as a device tensor: clipping never waits for the host.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(
    params: Iterable[torch.nn.Parameter], pp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh = defaultdict(list)
    plain = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh[id(g.device_mesh)].append(g)
        else:
            plain.append(g)
    device = grads[0].device if grads else torch.device("cpu")
    # CPU fp32 norm kernels accumulate a whole tensor in fp32 and lose up to ~1e-2 (relative) on large dense
    # tensors, which would make the norm depend on how tensors are sharded: accumulate in fp64 there (GPU
    # reductions are accurate in fp32). Plain CPU gradients: see cpu_squared_norm.
    acc = torch.float64 if device.type == "cpu" else torch.float32
    total_sq = torch.zeros((), dtype=acc, device=device)
    if plain and device.type == "cpu":
        total_sq += cpu_squared_norm(plain)
    elif plain:
        norms = torch._foreach_norm(plain, 2.0, dtype=acc)
        total_sq += torch.stack(norms).pow(2).sum()
    for group in by_mesh.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2.0, dtype=acc)), 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # one collective per mesh
        total_sq += norm.to(device=device, dtype=acc).pow(2)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt().float()


NORM_ROW = 4096  # elements per fp32 partial norm in cpu_squared_norm


def cpu_squared_norm(tensors) -> torch.Tensor:
    """The fp64 sum of squares of CPU tensors: fp32 norms of rows of ``NORM_ROW`` elements (each accurate to
    ~1e-7), squared and summed in fp64. Within ~1e-8 of an fp64 norm and independent of sharding to that
    precision, without the fp64 copy of every gradient that ``_foreach_norm(dtype=float64)`` makes (15x the
    time at gpt_125m's embedding; benchmarks/reports/2026-12-step-speed.md)."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1)
        cut = flat.numel() - flat.numel() % NORM_ROW
        if cut:
            parts.append(torch.linalg.vector_norm(flat[:cut].view(-1, NORM_ROW), 2.0, dim=1))
        if cut < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[cut:], 2.0).reshape(1))
    return torch.cat(parts).to(torch.float64).pow(2).sum()


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float, pp_group: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """Clip in place to ``max_norm`` (<= 0: no clipping); returns the pre-clip global norm.

    The coefficient stays on the device (no host sync): every gradient is multiplied by it, which is exact
    (``x * 1.0 == x``) when the norm is already below ``max_norm``. A non-finite norm leaves the gradients
    alone; the loss guard skips such a step."""
    params = list(params)
    norm = global_grad_norm(params, pp_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
        by_group = defaultdict(list)  # one foreach call per (mesh or plain, device, dtype)
        for p in params:
            g = p.grad
            if g is not None:
                mesh = id(g.device_mesh) if isinstance(g, DTensor) else None
                by_group[(mesh, g.device, g.dtype)].append(g)
        for (_, device, _), grads in by_group.items():
            torch._foreach_mul_(grads, coef.to(device))
    return norm

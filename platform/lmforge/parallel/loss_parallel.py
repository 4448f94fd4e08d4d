"""Loss parallelism: the cross-entropy computed on vocab-sharded logits, never gathering them (tp > 1).

Under tensor parallelism the output head is vocab-parallel (``tensor_parallel.VocabParallelOutput``): each tp rank
computes its ``V / tp`` columns of the logits. Gathering them costs ``N x V`` per rank in the compute dtype plus
the loss's fp32 chunk; with ``parallelism.loss_parallel`` (the default, as Megatron's vocab-parallel
cross-entropy and torchtitan's loss parallel) the head hands the loss its shard inside ``sharded_logits()`` and
``vocab_parallel_cross_entropy`` reads each chunk of the rank's logits once (its row maximum, its sum of
``exp(logit - that max)`` and the target's logit, taken on the rank whose columns hold it, 0 elsewhere) and
reduces over the tp group instead, in two collectives:

- the row maximum (all-reduce MAX), for a stable exp;
- the rank's exp sums rescaled to that maximum (times ``exp(rank max - row max)``) and the target logits, one
  ``[2, N]`` fp32 all-reduce SUM;

loss = log(sum) + max - target logit, averaged over the counted positions (targets -100 are not counted), as
``model/loss.py`` computes on whole rows. Backward needs no communication: each rank's gradient is
``softmax - onehot`` over its own columns (the softmax recomputed chunk by chunk from the saved max and sum),
and the head's DTensor backward reduces the hidden-state gradient as it does for gathered logits.

Everything else that reads logits (per-token log-likelihoods for downstream evaluation, generation) calls the
model outside ``sharded_logits()`` and gets them gathered.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from lmforge.model.gpt import cross_entropy_loss
from lmforge.model.loss import IGNORE_INDEX, rows_per_chunk

_SHARDED = contextvars.ContextVar("lmforge_sharded_logits", default=False)


@contextlib.contextmanager
def sharded_logits(enabled: bool = True) -> Iterator[None]:
    """Inside: a vocab-parallel head returns its ``Shard(-1)`` logits (a DTensor) instead of gathering them."""
    token = _SHARDED.set(enabled)
    try:
        yield
    finally:
        _SHARDED.reset(token)


def keep_logits_sharded() -> bool:
    return _SHARDED.get()


def loss_function(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training and evaluation loss of ``[B, T, V]`` logits: vocab-parallel when they arrive as a vocab-sharded
    DTensor (inside ``sharded_logits()``), ``model/loss.py``'s chunked cross-entropy otherwise."""
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets)
    return cross_entropy_loss(logits, targets)


def vocab_parallel_cross_entropy(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[B, T, V]`` logits sharded ``Shard(-1)`` over a 1-D tp mesh against ``[B, T]``
    targets (replicated over it), in fp32; the same scalar on every tp rank."""
    mesh = logits.device_mesh
    if mesh.ndim != 1 or not isinstance(logits.placements[0], Shard) or logits.placements[0].dim % logits.ndim != 2:
        raise ValueError(f"vocab-parallel cross-entropy needs logits Shard(-1) on a 1-D mesh, got {logits.placements}")
    vocab = logits.shape[-1]
    per_rank = -(-vocab // mesh.size())  # torch.chunk's split, as DTensor's Shard uses
    start = mesh.get_local_rank() * per_rank
    local = logits.to_local()
    return _VocabParallelCrossEntropy.apply(local.flatten(0, 1), targets.flatten(0, 1), start, mesh.get_group())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, targets: torch.Tensor, start: int, group) -> torch.Tensor:
        n, width = local.shape
        counted = targets != IGNORE_INDEX
        column = targets - start
        here = counted & (column >= 0) & (column < width)  # the target's column is on this rank
        safe = torch.where(here, column, 0)
        local_max = torch.empty(n, dtype=torch.float32, device=local.device)
        sums = torch.zeros(2, n, dtype=torch.float32, device=local.device)  # exp sums (rank's max), target logits
        step = rows_per_chunk(max(width, 1))
        for s in range(0, n, step):  # one read of each chunk: its max, its exp sum and the target's logit
            rows = slice(s, s + step)
            x = local[rows].float()
            local_max[rows] = x.amax(dim=-1)
            sums[0, rows] = (x - local_max[rows, None]).exp_().sum(dim=-1)
            sums[1, rows] = torch.where(here[rows], x.gather(1, safe[rows, None]).squeeze(1), 0)
        row_max = local_max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)  # collective: tp, N floats
        sums[0].mul_((local_max - row_max).exp_())  # each rank's sum rescaled to the row's max
        dist.all_reduce(sums, group=group)  # collective: tp, 2N floats (the exp sums and the target logits)
        total_exp, picked = sums[0], sums[1]
        row_loss = total_exp.log() + row_max - picked
        count = counted.sum()
        ctx.save_for_backward(local, counted, here, safe, row_max, total_exp, count)
        return torch.where(counted, row_loss, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        local, counted, here, safe, row_max, total_exp, count = ctx.saved_tensors
        n, width = local.shape
        grad = torch.empty_like(local)
        weight = torch.where(counted, grad_out.float() / count, 0.0)  # per row: d loss / d row's loss
        step = rows_per_chunk(max(width, 1))
        for s in range(0, n, step):
            rows = slice(s, s + step)
            p = (local[rows].float() - row_max[rows, None]).exp_().div_(total_exp[rows, None])  # softmax, own columns
            p.scatter_add_(1, safe[rows, None], -here[rows, None].float())  # - onehot where the target is here
            torch.mul(p, weight[rows, None], out=grad[rows])
        return grad, None, None, None

"""Expert parallelism (``parallelism.ep``): the routed experts of every MoE layer split E/ep per rank, tokens sent
to their experts' ranks and back by all-to-all.

Where ep comes from: it is borrowed from ``dp_shard`` (``parallel/mesh.py`` builds dp_shard as
``dp_shard_mod_ep`` x ``ep``). Every rank routes its own tokens (router, top-k, capacity: model/moe.py, unchanged,
so the router losses, loads and drops are exactly the single-device ones of its micro batch); then

    1. counts   all_to_all_single of the per-expert assignment counts [E] (each rank learns how many rows every
                source sends to each of its E/ep experts);
    2. dispatch all_to_all_single of the expert-sorted rows, uneven splits (the sum of a destination's counts);
    3. compute  the received rows regrouped by local expert (source-major -> expert-major), the experts' own
                grouped/loop path (``Experts.run``) on this rank's [E/ep, ...] weights;
    4. combine  the inverse regrouping and the reverse all_to_all_single: every row back at its source rank, in
                its original order, where model/moe.py applies the capacity mask and the gate weights.

Both all-to-alls are an autograd Function whose backward is the reverse exchange, so gradients of the tokens
reach their source ranks and the gradients of an expert's weights (summed over every source in the ep group)
stay on the rank that holds it.

Weights: ``w1, w2, w3`` become DTensors ``Shard(0)`` over the ``ep`` dim (the global [E, ...] shape and the
state-dict keys are those of one process: DCP reshards checkpoints across ep sizes); ``shard_experts`` then
FSDP-shards each layer's experts over the ranks holding the same experts (``dp_shard_mod_ep``; HSDP with
``dp_replicate``: replicas hold the same expert shards), with the gradient divided by the whole data-parallel degree: an expert's gradient is already
a sum over its ep group, so dividing by the size of the experts' own data-parallel group alone would count it ep times.

With tensor parallelism the router and the routed experts are replicated over tp (parallel/tensor_parallel.py):
every tp rank routes the same tokens (its data rank's micro batch; under SP the MoE block gathers the sequence
first) and dispatches them over its own ep group, ``mesh["ep"]`` at its tp index, so the tp peers hold identical
expert outputs and gradients and nothing is reduced over tp. With pipeline parallelism ``mesh["ep"]`` is the ep
group of this rank's stage(s): both ranks of a group run the same schedule, so their exchanges pair up.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lmforge.config.parallelism import ParallelismConfig
from lmforge.model.moe import Experts
from lmforge.parallel.mesh import ParallelMesh


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back_out, back_in = ctx.splits
        out = grad.new_empty((sum(back_out), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), back_out, back_in, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _regroup(x: torch.Tensor, sizes: List[int], rows: int, cols: int) -> torch.Tensor:
    """Rows in ``rows`` x ``cols`` chunks of ``sizes`` (row-major) -> the same chunks column-major."""
    chunks = x.split(sizes)
    return torch.cat([chunks[r * cols + c] for c in range(cols) for r in range(rows)])


class TokenDispatch:
    """The ``Experts.token_dispatch`` of one MoE layer under expert parallelism (ep ranks, E/ep experts each).

    ``destination_shift``: a fault for the parity harness's negative control (0 in training): rows meant for ep
    rank j are sent to rank (j + shift) % ep, i.e. to the wrong experts."""

    def __init__(self, group: dist.ProcessGroup, ep: int, experts: int):
        self.group, self.ep, self.local = group, ep, experts // ep
        self.destination_shift = 0

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local, shift = self.ep, self.local, self.destination_shift
        send = counts.reshape(ep, local)  # [destination rank, its local expert]
        if shift:
            order = [(d - shift) % ep for d in range(ep)]  # the chunk that destination d receives
            x = torch.cat([x.split(send.sum(1).tolist())[j] for j in order])
            send = send[order]
        recv = torch.empty_like(send)  # [source rank, local expert]
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)  # (collective: the counts)
        send_sizes, recv_sizes = send.sum(1).tolist(), recv.sum(1).tolist()  # host sync: the splits
        rows = all_to_all(x, recv_sizes, send_sizes, self.group)  # (collective: dispatch)
        by_source = recv.reshape(-1).tolist()
        grouped = _regroup(rows, by_source, ep, local)  # source-major -> local-expert-major
        w1, w2, w3 = [
            None if p is None else (p.to_local() if isinstance(p, DTensor) else p)
            for p in (experts.w1, experts.w2, experts.w3)
        ]
        out = experts.run(grouped, recv.sum(0), w1=w1, w2=w2, w3=w3)
        by_expert = recv.t().reshape(-1).tolist()
        out = _regroup(out, by_expert, local, ep)  # back to source-major
        out = all_to_all(out, send_sizes, recv_sizes, self.group)  # (collective: combine)
        if shift:
            chunks = out.split(send.sum(1).tolist())
            out = torch.cat([chunks[order.index(j)] for j in range(ep)])
        return out


def expert_modules(model: nn.Module) -> List[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh) -> None:
    """Split every MoE layer's experts over ``mesh["ep"]`` (Shard(0) DTensors, on the meta device before
    materialize) and install the all-to-all token dispatch. Model code stays single-device."""
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    for experts in expert_modules(model):
        for name in ("w1", "w2", "w3"):
            p = getattr(experts, name)
            if p is not None:
                setattr(experts, name, nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)], src_data_rank=None)))
        experts.token_dispatch = TokenDispatch(ep_mesh.get_group(), ep, experts.w1.shape[0])


def shard_experts(model: nn.Module, mesh: ParallelMesh, cfg: ParallelismConfig, mp_policy) -> None:
    """FSDP2 of each layer's experts over the ranks that hold the same experts (before the blocks are wrapped,
    which then leave the experts' parameters to these groups); gradients divided by the full dp degree."""
    from torch.distributed.fsdp import fully_shard

    # HSDP with dp_replicate > 1: the replicas hold the same expert shards (as for the dense part).
    dp_mesh = mesh["dp_replicate", "dp_shard_mod_ep"] if cfg.dp_replicate > 1 else mesh["dp_shard_mod_ep"]
    for experts in expert_modules(model):
        fully_shard(experts, mesh=dp_mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp_policy)
        experts.set_gradient_divide_factor(float(cfg.dp_replicate * cfg.dp_shard))
        if cfg.dp_shard // cfg.ep > 1:
            # Sum reductions then the division: a factor other than the shard group's size would otherwise be
            # NCCL's PREMUL_SUM, which gloo does not have. Not with a one-rank shard group: torch 2.13 divides its
            # gradient by the factor there already, and would divide again after the all-reduce.
            experts.set_force_sum_reduction_for_comms(True)


def token_dispatches(model: nn.Module) -> List[TokenDispatch]:
    """This model's installed dispatches (empty without expert parallelism)."""
    return [m.token_dispatch for m in expert_modules(model) if m.token_dispatch is not None]

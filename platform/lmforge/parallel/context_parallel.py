"""Context parallelism: one sequence split over the ``cp`` ranks, attention exact across the split.

Load-balanced causal layout. Each sequence of T tokens is cut into 2*cp chunks of c = T/(2*cp); cp rank r
holds chunks r and 2*cp-1-r (an early, cheap chunk and its late, expensive mirror), so every rank does the
same attention work under the causal mask::

    cp=2, T=8c      chunk:  0   1   2   3          rank 0 holds [0 | 3], rank 1 holds [1 | 2]
                    rank:   0   1   1   0

``ContextLayout`` shards a batch by it (tokens, targets, and the RoPE positions of the two chunks);
``apply_context_parallel`` (the cp step of ``parallelize()``) installs this rank's RoPE tables and an
attention function on every ``Attention`` module of the model, whose forward stays single-device code.

K/V exchange (``parallelism.cp_kv_exchange``), both exact (partial attentions merged by their log-sum-exp):

- ``ring``: cp steps; at step t a rank attends its queries to the K/V of rank (r - t) mod cp while the next
  block travels one rank along the ring (``batch_isend_irecv``, point to point, overlapped with the block's
  compute). Under the layout, a block from a lower rank is seen by all queries through its first chunk only,
  one from a higher rank by the second query chunk only: every off-diagonal step computes exactly half a
  block. Backward runs the ring again, K/V travelling with their gradient accumulators, which arrive home
  after one more hop. Memory: one K/V block in flight; forward saves q, k, v, out and the log-sum-exp.
- ``allgather``: one all-gather of K/V (backward: a reduce-scatter of their gradients), then SDPA of the
  local queries against the whole sequence with the causal mask by position. Simpler, one collective, but
  every rank holds the whole sequence's K/V.

Extension point (document masking): both paths decide visibility from (query position, key position) in
``visible``; a per-token document id can be threaded next to the positions and ANDed there.

Gradients: cp ranks hold replicas of the weights and each computes the mean loss over its own tokens (the
same count on every cp rank), so averaging gradients (FSDP over ``dp_shard_cp``) and losses (over ``dp_cp``)
across dp x cp gives the single-process mean over the global batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lmforge.model.gpt import Attention, RotaryTables, rope_tables


@dataclass(frozen=True)
class ContextLayout:
    """Rank ``rank`` of ``cp``: which positions of a ``seq_len`` sequence it holds (chunks r and 2cp-1-r)."""

    cp: int
    rank: int
    seq_len: int

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.cp - 1 - rank

    def positions(self, rank: Optional[int] = None, device=None) -> torch.Tensor:
        """The global positions rank ``rank`` (default this one) holds, in its local order: [2c] int64."""
        c = self.chunk
        first, second = self.chunks_of(self.rank if rank is None else rank)
        return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                          torch.arange(second * c, (second + 1) * c, device=device)])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``x`` along the sequence ``dim`` (tokens or targets [B, T] -> [B, 2c])."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"context parallelism: a sequence of {x.shape[dim]} tokens, expected {self.seq_len}")
        c = self.chunk
        first, second = self.chunks_of(self.rank)
        return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[Tq, Tk] bool: key position <= query position (causal). Document masking ANDs same-document here."""
    return k_pos[None, :] <= q_pos[:, None]


# ---- one block of attention with its log-sum-exp (fp32), and its backward --------------------------------------
def _block_forward(q, k, v, mask: Optional[torch.Tensor], scale: float):
    """q [B,H,Tq,D], k/v [B,H,Tk,D], mask [Tq,Tk] bool or None (all visible) -> out fp32, lse fp32 [B,H,Tq]."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out, lse


def _block_backward(q, k, v, mask, scale, lse, delta, dout):
    """Gradients of one block given the *final* log-sum-exp of its query rows and delta = rowsum(dout * out)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, vf.transpose(-1, -2))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, dk, dv


def _merge(out, lse, rows: slice, out_b, lse_b) -> None:
    """Online softmax: fold a partial attention (out_b, lse_b) of query ``rows`` into (out, lse), in place."""
    new = torch.logaddexp(lse[..., rows], lse_b)
    out[..., rows, :] = out[..., rows, :] * torch.exp(lse[..., rows] - new)[..., None] + \
        out_b * torch.exp(lse_b - new)[..., None]
    lse[..., rows] = new


def ring_plan(layout: ContextLayout, step: int) -> tuple[int, slice, slice, bool]:
    """Ring step ``step`` on this rank: (source rank of the K/V block, query rows, key columns, masked).

    Step 0 is the local block (causal by position); a lower rank's block is seen by every query through its
    first chunk only, a higher rank's by the second query chunk only (both fully visible there)."""
    r, c = layout.rank, layout.chunk
    src = (r - step) % layout.cp
    if src == r:
        return src, slice(None), slice(None), True
    if src < r:
        return src, slice(None), slice(0, c), False
    return src, slice(c, 2 * c), slice(None), False


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """What a rank sends along the ring: its K and V blocks, stacked ([2, B, H, 2c, D])."""
    return torch.stack([k, v])


class _Ring:
    """Point-to-point ring over the cp group: send to rank r+1, receive from rank r-1."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, send: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, List]:
        """Post this hop (send ``send`` on, receive the previous rank's); returns (receive buffer, requests)."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send.contiguous(), self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests: List) -> None:
        for req in requests:
            req.wait()


class RingAttention(torch.autograd.Function):
    """Exact causal attention of this rank's queries over the whole sequence, K/V passed around a ring."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: ContextLayout):
        ring = _Ring(group, layout.rank, layout.cp)
        scale = 1.0 / math.sqrt(q.shape[-1])
        pos = layout.positions(device=q.device)
        diagonal = visible(pos, pos)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv, outgoing = torch.stack([k, v]), pack_kv(k, v)
        for step in range(layout.cp):
            pending = ring.start(outgoing) if step < layout.cp - 1 else None  # the next block travels meanwhile
            _, rows, cols, masked = ring_plan(layout, step)
            out_b, lse_b = _block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                          diagonal if masked else None, scale)
            _merge(out, lse, rows, out_b, lse_b)
            if pending is not None:
                _Ring.wait(pending[1])
                kv = outgoing = pending[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.scale = group, layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        ring = _Ring(ctx.group, layout.rank, layout.cp)
        pos = layout.positions(device=q.device)
        diagonal = visible(pos, pos)
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, outgoing = torch.stack([k, v]), pack_kv(k, v)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(layout.cp):
            pending = ring.start(outgoing) if step < layout.cp - 1 else None
            _, rows, cols, masked = ring_plan(layout, step)
            dq_b, dk_b, dv_b = _block_backward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                               diagonal if masked else None, scale, lse[..., rows],
                                               delta[..., rows], dout[..., rows, :])
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            dkv, grads = ring.start(dkv, tag=1)  # after cp hops, the accumulator is back with the block's owner
            _Ring.wait(grads)
            if pending is not None:
                _Ring.wait(pending[1])
                kv = outgoing = pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new leading dim (one slot per cp rank); backward: reduce-scatter of the gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(mine, grad.contiguous().flatten(0, 1), group=ctx.group)
        return mine, None


def allgather_attention(q, k, v, group, layout: ContextLayout) -> torch.Tensor:
    """Exact causal attention of this rank's queries against the all-gathered K/V of the whole sequence."""
    kv = _GatherSequence.apply(pack_kv(k, v), group)  # [cp, 2, B, H, 2c, D], rank order
    keys = torch.cat(list(kv[:, 0].unbind(0)), dim=-2)
    values = torch.cat(list(kv[:, 1].unbind(0)), dim=-2)
    k_pos = torch.cat([layout.positions(rank=s, device=q.device) for s in range(layout.cp)])
    mask = visible(layout.positions(device=q.device), k_pos)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


EXCHANGES = {"ring": RingAttention.apply, "allgather": allgather_attention}


class ContextParallelRotaryTables(RotaryTables):
    """RoPE tables at this rank's positions only (its two chunks), so ``Attention``'s ``cos[:seqlen]`` of a
    [B, 2c] shard is exactly the rotation of those tokens."""

    def __init__(self, tables: RotaryTables, layout: ContextLayout):
        nn.Module.__init__(self)
        self.head_dim, self.seq_len, self.theta = tables.head_dim, tables.seq_len, tables.theta
        self.layout = layout
        self.register_buffer("cos", tables.cos[: 2 * layout.chunk], persistent=False)
        self.register_buffer("sin", tables.sin[: 2 * layout.chunk], persistent=False)

    def reset(self, device: Optional[torch.device] = None) -> None:
        device = device or self.cos.device
        cos, sin = rope_tables(self.head_dim, self.seq_len, self.theta, device=device)
        pos = self.layout.positions(device=device)
        self.cos, self.sin = cos[pos], sin[pos]


def context_attention(group: dist.ProcessGroup, layout: ContextLayout, exchange: str) -> Callable:
    """The attention function (``Attention.attend``) of a cp rank: [B, H, 2c, D] q/k/v -> [B, H, 2c, D]."""
    fn = EXCHANGES[exchange]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query: K/V repeated to the query heads, then exchanged
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return fn(q, k, v, group, layout)

    return attend


def layout_of(mesh: DeviceMesh, seq_len: int) -> ContextLayout:
    cp = mesh["cp"]
    return ContextLayout(cp.size(), cp.get_local_rank(), seq_len)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, exchange: str) -> ContextLayout:
    """The cp step of ``parallelize()`` (after TP): this rank's RoPE tables and the exchange's attention on
    every ``Attention`` module. Returns the layout the engine shards each batch by."""
    layout = layout_of(mesh, model.cfg.seq_len)
    model.rope = ContextParallelRotaryTables(model.rope, layout)
    attend = context_attention(mesh["cp"].get_group(), layout, exchange)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = attend
    return layout

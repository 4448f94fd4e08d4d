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

K/V are exchanged at their own n_kv heads (GQA/MQA: n_kv/n_heads of the bytes) and expanded to the query heads
inside each block's compute only.

Document masking (``data.document_masking``): every cp rank holds the whole batch, so the model's
``document_mask`` builder (``ContextDocumentMask``) takes the whole batch's positions [B, T]: this rank's tokens
are rotated at their in-document positions, and both exchanges mask every block by ``visible`` with the
document ids of the query and key chunks (block-diagonal causal, exact; the key ids of any rank's chunks are
computed locally, nothing extra travels).

Pipeline parallelism: the cp step applies to a pipeline rank's part like to a whole model (its stages share the
part's RoPE tables and attention modules); the engine cuts the batch before the schedule.

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

from lmforge.model.document_mask import document_ids
from lmforge.model.gpt import Attention, RotaryTables, rope_tables
from lmforge.model.rope import apply_rope
from lmforge.parallel.mesh import ParallelMesh


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
        return torch.cat(
            [
                torch.arange(first * c, (first + 1) * c, device=device),
                torch.arange(second * c, (second + 1) * c, device=device),
            ]
        )

    def shard(self, x: torch.Tensor, dim: int = 1, rank: Optional[int] = None) -> torch.Tensor:
        """Rank ``rank``'s (default this one's) two chunks of ``x`` along the sequence ``dim`` (tokens, targets,
        document positions or ids [B, T] -> [B, 2c])."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"context parallelism: a sequence of {x.shape[dim]} tokens, expected {self.seq_len}")
        c = self.chunk
        first, second = self.chunks_of(self.rank if rank is None else rank)
        return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


def visible(
    q_pos: Optional[torch.Tensor],
    k_pos: Optional[torch.Tensor],
    q_doc: Optional[torch.Tensor] = None,
    k_doc: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Which keys a query sees. Causal: [Tq, Tk] bool, key position <= query position (positions None: every
    key, a block wholly in the past). Document masking (``q_doc`` [B, Tq], ``k_doc`` [B, Tk] document ids): ANDed
    with same-document, [B, 1, Tq, Tk]. None: everything visible."""
    causal = None if q_pos is None else k_pos[None, :] <= q_pos[:, None]
    if q_doc is None:
        return causal
    same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
    return same if causal is None else same & causal


# ---- one block of attention with its log-sum-exp (fp32), and its backward --------------------------------------
# K/V travel at their own n_kv heads (grouped-query / multi-query: n_kv/n_heads of the bytes); a block expands
# them to the query heads locally and sums the expanded heads' dK/dV back before they travel home.
def _expand(k: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, T, D] -> [B, heads, T, D]: query head h reads K/V head h // (heads / H_kv) (SDPA's GQA)."""
    rep = heads // k.shape[1]
    return k if rep == 1 else k.repeat_interleave(rep, dim=1)


def _fold(dk: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of ``_expand``: [B, heads, T, D] gradients summed per K/V head -> [B, H_kv, T, D]."""
    b, heads, t, d = dk.shape
    return dk if heads == kv_heads else dk.view(b, kv_heads, heads // kv_heads, t, d).sum(2)


def _block_forward(q, k, v, mask: Optional[torch.Tensor], scale: float):
    """q [B,H,Tq,D], k/v [B,H_kv,Tk,D], mask [Tq,Tk] or [B,1,Tq,Tk] bool or None (all visible) -> out fp32,
    lse fp32 [B,H,Tq]. A query row that sees no key of the block (another document) gets out 0, lse -inf."""
    heads = q.shape[1]
    scores = torch.matmul(q.float(), _expand(k, heads).float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # exp(-inf - 0) = 0, not nan
    out = torch.matmul(torch.exp(scores - finite[..., None]), _expand(v, heads).float())
    return out, lse


def _block_backward(q, k, v, mask, scale, lse, delta, dout):
    """Gradients of one block given the *final* log-sum-exp of its query rows and delta = rowsum(dout * out);
    dK/dV at the block's n_kv heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    qf, kf, vf = q.float(), _expand(k, heads).float(), _expand(v, heads).float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, vf.transpose(-1, -2))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _merge(out, lse, rows: slice, out_b, lse_b) -> None:
    """Online softmax: fold a partial attention (out_b, lse_b) of query ``rows`` into (out, lse), in place."""
    new = torch.logaddexp(lse[..., rows], lse_b)
    out[..., rows, :] = (
        out[..., rows, :] * torch.exp(lse[..., rows] - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None]
    )
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
    """What a rank sends along the ring: its K and V blocks at n_kv heads, stacked ([2, B, H_kv, 2c, D])."""
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
        ops = [
            dist.P2POp(dist.isend, send.contiguous(), self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(requests: List) -> None:
        for req in requests:
            req.wait()


def ring_masks(layout: ContextLayout, docs: Optional[torch.Tensor], device) -> List[Optional[torch.Tensor]]:
    """The mask of each ring step's block (``ring_plan``'s rows x columns): causal on the diagonal, none off it;
    document masking (``docs`` [B, T] ids of the whole sequence) ANDs same-document into every block. Every
    rank holds the whole batch, so the key ids of any rank's chunks are known locally: nothing extra travels."""
    pos = layout.positions(device=device)
    q_doc = None if docs is None else layout.shard(docs)
    masks = []
    for step in range(layout.cp):
        src, rows, cols, masked = ring_plan(layout, step)
        if docs is None:
            masks.append(visible(pos, pos) if masked else None)
            continue
        k_doc = layout.shard(docs, rank=src)
        masks.append(visible(pos if masked else None, pos, q_doc[:, rows], k_doc[:, cols]))
    return masks


class RingAttention(torch.autograd.Function):
    """Exact causal attention of this rank's queries over the whole sequence, K/V passed around a ring;
    ``docs`` ([B, T] document ids, or None): within each document only."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: ContextLayout, docs: Optional[torch.Tensor] = None, scale=None):
        ring = _Ring(group, layout.rank, layout.cp)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        masks = ring_masks(layout, docs, q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv, outgoing = torch.stack([k, v]), pack_kv(k, v)
        for step in range(layout.cp):
            pending = ring.start(outgoing) if step < layout.cp - 1 else None  # the next block travels meanwhile
            _, rows, cols, _ = ring_plan(layout, step)
            out_b, lse_b = _block_forward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], masks[step], scale)
            _merge(out, lse, rows, out_b, lse_b)
            if pending is not None:
                _Ring.wait(pending[1])
                kv = outgoing = pending[0]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.scale, ctx.masks = group, layout, scale, masks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        ring = _Ring(ctx.group, layout.rank, layout.cp)
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, outgoing = torch.stack([k, v]), pack_kv(k, v)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(layout.cp):
            pending = ring.start(outgoing) if step < layout.cp - 1 else None
            _, rows, cols, _ = ring_plan(layout, step)
            dq_b, dk_b, dv_b = _block_backward(
                q[..., rows, :],
                kv[0][..., cols, :],
                kv[1][..., cols, :],
                ctx.masks[step],
                scale,
                lse[..., rows],
                delta[..., rows],
                dout[..., rows, :],
            )
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            dkv, grads = ring.start(dkv, tag=1)  # after cp hops, the accumulator is back with the block's owner
            _Ring.wait(grads)
            if pending is not None:
                _Ring.wait(pending[1])
                kv = outgoing = pending[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


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


def allgather_attention(
    q, k, v, group, layout: ContextLayout, docs: Optional[torch.Tensor] = None, scale: Optional[float] = None
) -> torch.Tensor:
    """Exact causal attention of this rank's queries against the all-gathered K/V (n_kv heads) of the whole
    sequence; ``docs`` ([B, T] document ids, or None): within each document only."""
    kv = _GatherSequence.apply(pack_kv(k, v), group)  # [cp, 2, B, H_kv, 2c, D], rank order
    keys = torch.cat(list(kv[:, 0].unbind(0)), dim=-2)
    values = torch.cat(list(kv[:, 1].unbind(0)), dim=-2)
    k_pos = torch.cat([layout.positions(rank=s, device=q.device) for s in range(layout.cp)])
    q_doc = k_doc = None
    if docs is not None:
        q_doc = layout.shard(docs)
        k_doc = torch.cat([layout.shard(docs, rank=s) for s in range(layout.cp)], dim=1)
    mask = visible(layout.positions(device=q.device), k_pos, q_doc, k_doc)
    return torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1], scale=scale
    )


EXCHANGES = {"ring": RingAttention.apply, "allgather": allgather_attention}


class ContextParallelRotaryTables(RotaryTables):
    """RoPE tables at this rank's positions only (its two chunks), so ``Attention``'s ``cos[:seqlen]`` of a
    [B, 2c] shard is exactly the rotation of those tokens. ``full_cos``/``full_sin``: the whole tables, which
    document-masked forwards index by each token's position inside its document."""

    def __init__(self, tables: RotaryTables, layout: ContextLayout):
        nn.Module.__init__(self)
        self.head_dim, self.seq_len, self.theta = tables.head_dim, tables.seq_len, tables.theta
        self.layout = layout
        self.register_buffer("cos", tables.cos[: 2 * layout.chunk], persistent=False)
        self.register_buffer("sin", tables.sin[: 2 * layout.chunk], persistent=False)
        self.register_buffer("full_cos", tables.cos, persistent=False)
        self.register_buffer("full_sin", tables.sin, persistent=False)

    def reset(self, device: Optional[torch.device] = None) -> None:
        device = device or self.cos.device
        cos, sin = rope_tables(self.head_dim, self.seq_len, self.theta, device=device)
        pos = self.layout.positions(device=device)
        self.cos, self.sin, self.full_cos, self.full_sin = cos[pos], sin[pos], cos, sin


class ContextDocumentMask:
    """A cp rank's document-masked attention for one forward (``DocumentMask``'s role, model/document_mask.py):
    built from the *whole* batch's document positions [B, T]; RoPE at this rank's tokens' in-document
    positions, the K/V exchange masked by document ids (block-diagonal causal, exact)."""

    def __init__(
        self,
        positions: torch.Tensor,
        rope: ContextParallelRotaryTables,
        exchange: Callable,
        group: dist.ProcessGroup,
        layout: ContextLayout,
    ):
        local = layout.shard(positions)
        self.cos, self.sin = rope.full_cos[local], rope.full_sin[local]  # [B, 2c, D]
        self.docs = document_ids(positions)
        self.exchange, self.group, self.layout = exchange, group, layout

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, scale: Optional[float] = None
    ) -> torch.Tensor:
        """q: [B, 2c, Hq, D], k/v: [B, 2c, Hkv, D] before RoPE -> [B, 2c, Hq * D]."""
        bsz, seqlen = q.shape[:2]
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.exchange(q, k, v, self.group, self.layout, self.docs, scale)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)


def context_attention(group: dist.ProcessGroup, layout: ContextLayout, exchange: str) -> Callable:
    """The attention function (``Attention.attend``) of a cp rank: [B, H, 2c, D] q, [B, H_kv, 2c, D] k/v ->
    [B, H, 2c, D]. K/V are exchanged at their n_kv heads, expanded to the query heads only where attended."""
    fn = EXCHANGES[exchange]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        return fn(q, k, v, group, layout, None, scale)

    return attend


def layout_of(mesh: ParallelMesh, seq_len: int) -> ContextLayout:
    cp = mesh["cp"]
    return ContextLayout(cp.size(), cp.get_local_rank(), seq_len)


def apply_context_parallel(model: nn.Module, mesh: ParallelMesh, exchange: str) -> ContextLayout:
    """The cp step of ``parallelize()`` (after TP): this rank's RoPE tables and the exchange's attention on
    every ``Attention`` module, and the document-mask builder of document-masked forwards (which take the
    whole batch's positions). Returns the layout the engine shards each batch by."""
    layout = layout_of(mesh, model.cfg.seq_len)
    rope = model.rope = ContextParallelRotaryTables(model.rope, layout)
    group = mesh["cp"].get_group()
    attend = context_attention(group, layout, exchange)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = attend
    model.document_mask = lambda positions: ContextDocumentMask(positions, rope, EXCHANGES[exchange], group, layout)
    return layout

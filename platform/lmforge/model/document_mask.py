"""Document masking for packed sequences: attention causal within a document only, RoPE positions restarting
at every document.

A packed training sample holds pieces of several documents, each ending with the tokenizer's EOD token
(megatron-core's GPTDataset concatenates the documents of a shard, EOD included, and cuts samples out of the
stream). A batch carries one compact tensor, ``positions`` [B, T] int64 (:func:`document_positions`): each
token's position inside its document, 0 at the sample's first token and at the token after each EOD (the
EOD closes the document it ends). Document ids follow from it (:func:`document_ids`), so nothing else is
carried, and the [B, 1, T, T] mask is built once per forward, on the device, never in the loader.

``DecoderStack.forward(tokens, positions)`` builds a :class:`DocumentMask` once and hands it to every layer;
``Attention.forward`` then calls :meth:`DocumentMask.attention` instead of its causal SDPA. Backends
(``data.document_attention``):

- ``sdpa``: ``scaled_dot_product_attention`` with the exact boolean block-diagonal causal mask (key <= query
  and same document). Any device; the reference. Its CPU kernels compute the full T x T square.
- ``flex``: ``flex_attention`` with a ``BlockMask`` from the same predicate: blocks outside every document are
  skipped. Trains on CUDA under ``torch.compile`` (``parallelism.compile=true``; eager is torch's unfused
  path, which it announces with a warning). On the CPU torch 2.13 runs its forward only, eager or compiled (no
  backward), so ``config/document_masking.py`` refuses it for training there.

- ``varlen``: torch's ``varlen_attn`` (flash attention, CUDA, bf16/fp16). The batch is packed into one
  [B*T] token stream (:func:`pack_batch`; rows are contiguous, so it is a view) whose documents are the
  sequences of ``cu_seqlens`` (:func:`varlen_boundaries`: every ``positions == 0`` starts one, each row's first
  token included, so no document crosses a row), attended causally one by one and unpacked to [B, T]. Only the
  documents' own squares are computed. ``max_seqlen`` is the row length T, an upper bound of every document's
  length that needs no device-to-host copy; the starts (``nonzero``) take one per forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from lmforge.model.rope import apply_rope

BACKENDS = ("sdpa", "flex", "varlen")


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[B, T] int64: position of each token inside its document; restarts at 0 after every ``eod`` token."""
    bsz, seqlen = tokens.shape
    start = torch.zeros_like(tokens, dtype=torch.bool)
    start[:, 0] = True
    start[:, 1:] = tokens[:, :-1] == eod
    index = torch.arange(seqlen, device=tokens.device).expand(bsz, seqlen)
    last_start = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: 0 for the sample's first document, +1 at each document start (``positions == 0``)."""
    return (positions == 0).cumsum(dim=1) - 1


def document_square_sum(positions: torch.Tensor) -> int:
    """Sum over the batch's documents of length^2: the query-key pairs of the per-document full squares."""
    ids = document_ids(positions)
    flat = (ids + torch.arange(ids.shape[0], device=ids.device)[:, None] * ids.shape[1]).flatten()
    return int((torch.bincount(flat).to(torch.int64) ** 2).sum())


def varlen_boundaries(positions: torch.Tensor) -> torch.Tensor:
    """[N + 1] int32: where each of the batch's N documents starts in the packed [B*T] stream (the rows one after
    another, :func:`pack_batch`), then B*T; ``varlen_attn``'s ``cu_seqlens``. A document starts at every
    ``positions == 0``, so also at each row's first token: document i is stream[cu[i]:cu[i+1]]."""
    flat = positions.flatten()
    starts = torch.nonzero(flat == 0).flatten()
    end = torch.tensor([flat.numel()], dtype=starts.dtype, device=flat.device)
    return torch.cat([starts, end]).to(torch.int32)


def pack_batch(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [B*T, ...]: the rows of a batch one after another (the varlen token stream)."""
    return x.flatten(0, 1)


def unpack_batch(x: torch.Tensor, bsz: int) -> torch.Tensor:
    """[B*T, ...] -> [B, T, ...], the inverse of :func:`pack_batch`."""
    return x.unflatten(0, (bsz, x.shape[0] // bsz))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    n_rep: int,
    kernel=None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] (rotated) -> [B, T, Hq * D]: causal attention within each document
    of the packed stream. ``kernel``: ``varlen_attn``'s signature (default torch's; the CPU test passes an SDPA
    loop over the same ``cu_seqlens``)."""
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel
    bsz, seqlen = q.shape[:2]
    out = kernel(
        pack_batch(q),
        pack_batch(k),
        pack_batch(v),
        cu_seqlens,
        cu_seqlens,
        seqlen,
        seqlen,
        window_size=(-1, 0),
        enable_gqa=n_rep > 1,
        scale=scale,
    )
    return unpack_batch(out, bsz).flatten(2)


def segment_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    window_size=(-1, 0),
    enable_gqa: bool = False,
    scale: Optional[float] = None,
    **_,
) -> torch.Tensor:
    """``varlen_attn``'s contract (as :func:`varlen_attention` calls it) on any device: causal SDPA on each
    segment ``[cu[i], cu[i+1])`` of the packed [total, H, D] stream, on its own. The exact stand-in of torch's
    CUDA-only kernel for the layout around it (tests/unit/test_document_mask.py, gpu_check's dry run)."""
    if cu_q is not cu_k or cu_q.dtype != torch.int32 or tuple(window_size) != (-1, 0):
        raise ValueError("segment_sdpa: one int32 cu_seqlens for queries and keys, causal window (-1, 0)")
    bounds = cu_q.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or max(b - a for a, b in zip(bounds, bounds[1:])) > max_q:
        raise ValueError(
            f"segment_sdpa: cu_seqlens {bounds[:4]}... do not cover the {q.shape[0]} tokens in "
            f"segments of at most {max_q}"
        )
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, enable_gqa=enable_gqa, scale=scale
            ).transpose(0, 1)
            for a, b in zip(bounds, bounds[1:])
        ]
    )


@dataclass
class DocumentMask:
    """What every layer's attention needs for one forward: per-token RoPE tables and the mask of the backend."""

    cos: torch.Tensor  # [B, T, head_dim]
    sin: torch.Tensor
    backend: str
    mask: Optional[torch.Tensor] = None  # sdpa: [B, 1, T, T] bool, True = attend
    block_mask: Optional[object] = None  # flex: torch's BlockMask
    cu_seqlens: Optional[torch.Tensor] = None  # varlen: [N + 1] int32 document starts in the packed stream

    @classmethod
    def build(cls, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str) -> "DocumentMask":
        """``positions`` [B, T] (see :func:`document_positions`); ``cos``/``sin`` the model's [seq_len, D] tables."""
        if backend not in BACKENDS:
            raise ValueError(f"document attention backend {backend!r}: expected one of {BACKENDS}")
        ids = document_ids(positions)
        bsz, seqlen = positions.shape
        out = cls(cos[positions], sin[positions], backend)
        if backend == "sdpa":
            causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=positions.device).tril()
            out.mask = (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]
        elif backend == "varlen":
            out.cu_seqlens = varlen_boundaries(positions)
        else:
            from torch.nn.attention.flex_attention import create_block_mask

            def same_document_causal(b, h, q, k):
                return (k <= q) & (ids[b, q] == ids[b, k])

            out.block_mask = create_block_mask(same_document_causal, bsz, None, seqlen, seqlen, device=positions.device)
        return out

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, scale: Optional[float] = None
    ) -> torch.Tensor:
        """q: [B, T, Hq, D], k/v: [B, T, Hkv, D] before RoPE -> [B, T, Hq * D] (rotated, masked attention);
        ``scale``: the softmax scale (None = 1/sqrt(D))."""
        bsz, seqlen = q.shape[:2]
        q, k = apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)
        if self.backend == "varlen":
            return varlen_attention(q, k, v, self.cu_seqlens, n_rep, scale=scale)
        if self.backend == "sdpa":
            if n_rep > 1:
                k = k.repeat_interleave(n_rep, dim=2)
                v = v.repeat_interleave(n_rep, dim=2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = flex_attention(q, k, v, block_mask=self.block_mask, enable_gqa=n_rep > 1, scale=scale)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)

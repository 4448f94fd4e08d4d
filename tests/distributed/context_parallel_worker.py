"""Rank-side code of the context-parallel tests (started by tests/harness.py ``run_ranks``).

``run_cases`` runs the parity harness's cases (``parallel_worker.run_case``: real config, NativeEngine, real
BatchStream, 3 AdamW steps), resumes (``resume_from``: ``parallel_worker.resume_case`` from a checkpoint an
earlier case saved) plus two cp-specific kinds:

- ``kernel``: the cp attention of each exchange against single-device SDPA on the same full sequence, values
  and gradients of q, k, v (every rank builds the same full tensors from one seed and keeps its chunks);
- ``wrong_exchange``: the negative control, a parity case whose ring sends the two K/V chunks swapped.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.distributed as dist
from distributed.parallel_worker import init_world, resume_case, run_case


@contextlib.contextmanager
def swapped_kv_chunks():
    """A deliberately wrong K/V exchange: each rank sends its second chunk where its first belongs."""
    from lmforge.parallel import context_parallel as cp

    right = cp.pack_kv

    def wrong(k, v):
        c = k.shape[-2] // 2
        return right(torch.cat([k[..., c:, :], k[..., :c, :]], -2), torch.cat([v[..., c:, :], v[..., :c, :]], -2))

    cp.pack_kv = wrong
    try:
        yield
    finally:
        cp.pack_kv = right


def kernel_case(seq_len: int = 64, heads: int = 4, head_dim: int = 16, batch: int = 2) -> Dict[str, float]:
    """Max |difference| of out, dq, dk, dv between each exchange over the cp=world group and full SDPA, for
    grouped-query (2 K/V heads, exchanged unexpanded) and multi-query (1) K/V, causal and document-masked (ids
    from a real EOD scan of random tokens, several documents per row; the reference: SDPA with the
    block-diagonal causal mask). Every rank builds the same full tensors from one seed and keeps its chunks."""
    from lmforge.model.document_mask import document_ids, document_positions
    from lmforge.parallel.context_parallel import EXCHANGES, ContextLayout

    group = dist.group.WORLD
    layout = ContextLayout(dist.get_world_size(), dist.get_rank(), seq_len)
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(2))
    docs = document_ids(document_positions(torch.randint(0, 6, (batch, seq_len), generator=gen), eod=0))
    assert int(docs.max()) >= 3, "several documents per row"
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    out = {}
    for kv_heads in (2, 1):
        k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen) for _ in range(2))
        for masked in (False, True):
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            mask = (causal & (docs[:, :, None] == docs[:, None, :]))[:, None] if masked else causal
            ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=True)
            ref.backward(dout)
            for name, fn in EXCHANGES.items():
                local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
                got = fn(*local, group, layout, docs if masked else None)
                got.backward(layout.shard(dout, dim=2))
                pairs = [(got, ref)] + [(t.grad, f.grad) for t, f in zip(local, full)]
                err = max(float((a.detach() - layout.shard(b.detach(), dim=2)).abs().max()) for a, b in pairs)
                out[f"{name} kv{kv_heads}{' docmask' if masked else ''}"] = err
    return out


def run_cases(cases: Dict[str, dict], samples: List[List[int]], steps: int) -> Dict[str, dict]:
    init_world()
    out = {}
    for name, case in cases.items():
        case = dict(case)
        if case.pop("kernel", False):
            out[name] = kernel_case()
            continue
        if "resume_from" in case:  # a checkpoint an earlier case of this launch saved, under another layout
            out[name] = resume_case(case["overrides"], samples, steps, case["resume_from"], more=case.get("more", 1))
            dist.barrier()
            continue
        wrong = case.pop("wrong_exchange", False)
        with swapped_kv_chunks() if wrong else contextlib.nullcontext():
            out[name] = run_case(samples=samples, **{"steps": steps, **case})
    return out

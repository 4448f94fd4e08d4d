"""Rank-side code of the context-parallel tests (started by tests/harness.py ``run_ranks``).

``run_cases`` runs the parity harness's cases (``parallel_worker.run_case``: real config, NativeEngine, real
BatchStream, 5 AdamW steps) plus two cp-specific kinds:

- ``kernel``: the cp attention of each exchange against single-device SDPA on the same full sequence, values
  and gradients of q, k, v (every rank builds the same full tensors from one seed and keeps its chunks);
- ``wrong_exchange``: the negative control, a parity case whose ring sends the two K/V chunks swapped.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List

import torch
import torch.distributed as dist

from distributed.parallel_worker import init_world, run_case


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
    """Max |difference| of out, dq, dk, dv between each exchange over the cp=world group and full SDPA."""
    from lmforge.parallel.context_parallel import ContextLayout, EXCHANGES

    group = dist.group.WORLD
    layout = ContextLayout(dist.get_world_size(), dist.get_rank(), seq_len)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    out = {}
    for name, fn in EXCHANGES.items():
        local = [layout.shard(t, dim=2).detach().requires_grad_() for t in (q, k, v)]
        got = fn(*local, group, layout)
        got.backward(layout.shard(dout, dim=2))
        pairs = [(got, ref)] + [(t.grad, f.grad) for t, f in zip(local, full)]
        out[name] = max(float((a - layout.shard(b, dim=2)).abs().max()) for a, b in pairs)
    return out


def run_cases(cases: Dict[str, dict], samples: List[List[int]], steps: int) -> Dict[str, dict]:
    init_world()
    out = {}
    for name, case in cases.items():
        case = dict(case)
        if case.pop("kernel", False):
            out[name] = kernel_case()
            continue
        wrong = case.pop("wrong_exchange", False)
        with swapped_kv_chunks() if wrong else contextlib.nullcontext():
            out[name] = run_case(samples=samples, **{"steps": steps, **case})
    return out

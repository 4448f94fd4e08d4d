"""The global gradient norm on CPU (parallel/grad_clip.py): fp32 norms of rows summed in fp64 equal an fp64
norm to ~1e-8, however the tensor is split into shards; a whole-tensor fp32 norm (the negative control) does not."""

from __future__ import annotations

import torch

from lmforge.parallel.grad_clip import NORM_ROW, clip_grad_norm, cpu_squared_norm


def dense_gradient() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    rows = 4099  # not a multiple of NORM_ROW elements in total: a tail row too
    g = torch.randn(rows, 2048, generator=gen) * torch.rand(rows, 1, generator=gen)
    assert g.numel() % NORM_ROW
    return g


def test_cpu_squared_norm_is_an_fp64_norm_whatever_the_sharding():
    g = dense_gradient()
    truth = g.double().pow(2).sum()
    whole = cpu_squared_norm([g])
    assert whole.dtype == torch.float64
    assert abs(whole / truth - 1) < 1e-7
    # FSDP-like row shards of uneven sizes and a column split: the same sum of squares to ~1e-8
    rows = cpu_squared_norm([g[:1000], g[1000:3001], g[3001:]])
    cols = cpu_squared_norm([g[:, :700].contiguous(), g[:, 700:].contiguous()])
    assert abs(rows / whole - 1) < 1e-7 and abs(cols / whole - 1) < 1e-7
    # Negative control: torch's whole-tensor fp32 norm on CPU is off by far more (why grad_clip avoids it)
    fp32 = torch.linalg.vector_norm(g).double() ** 2
    assert abs(fp32 / truth - 1) > 1e-5


def test_clip_grad_norm_matches_torch_in_fp64():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((300, 70), (5,), (8192,))]
    for p in params:
        p.grad = torch.randn(p.shape)
    ref = [p.detach().clone().double().requires_grad_() for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.double()
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    got = clip_grad_norm(params, 0.5)
    assert abs(got.item() / want.item() - 1) < 1e-6
    for r, p in zip(ref, params):
        torch.testing.assert_close(p.grad, r.grad.float(), rtol=1e-6, atol=1e-7)

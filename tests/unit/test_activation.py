"""The GELU of ``mlp: gelu`` is one function, eager and compiled (model/activation.py)."""

import torch
import torch.nn.functional as F

from lmforge.model.activation import gelu_tanh


def test_compiled_gelu_is_gpt2s_tanh_gelu_forward_and_backward():
    x = torch.linspace(-12.0, 12.0, 4001, dtype=torch.float64).to(torch.float32).requires_grad_(True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    ref = F.gelu(x, approximate="tanh")
    (ref_grad,) = torch.autograd.grad(ref, x, g)
    eager = gelu_tanh(x)
    assert torch.equal(eager, ref)  # eager is torch's own kernel, bit for bit
    # aot_eager runs the traced graph (the sigmoid form, is_compiling() is true) without inductor codegen: cheap.
    compiled = torch.compile(gelu_tanh, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (grad,) = torch.autograd.grad(out, x, g)
    assert not torch.equal(out, ref)  # the graph ran the written-out form, not torch's kernel
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    # Negative control: the exact (erf) GELU is a different function, off by far more than the tolerance.
    exact = F.gelu(x, approximate="none")
    assert (exact - ref).abs().max() > 1e-4
    assert not torch.allclose(out, exact, rtol=1e-6, atol=1e-6)

"""Rotary position embeddings in the rotate-half layout (the one Hugging Face's Llama uses): the tables and their
application, shared by the GPT (``model/gpt.py``), document-masked attention (``model/document_mask.py``) and the
KV-cache decoder."""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim] in the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, D] (or [B, T, D]: per-sample positions), the ``rope_tables`` layout.

    Rotate-half RoPE, ``x * cos + [-x2, x1] * sin``. Eager, in two passes over x forward and two backward
    (:class:`RotateHalf`); inside a ``torch.compile`` graph (and for a tensor subclass such as a DTensor, or tables
    that need a gradient) as :func:`rope_formula`, which inductor fuses into one."""
    if torch.compiler.is_compiling() or type(x) is not torch.Tensor or cos.requires_grad or sin.requires_grad:
        return rope_formula(x, cos, sin)
    return RotateHalf.apply(x, cos.to(x.dtype), sin.to(x.dtype))


def rope_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` written with differentiable ops, computed on x viewed as its two halves
    ``[..., 2, D/2]``: the half swap is one ``flip`` and the sign lives in the (small) sin table, so no
    concatenation or negation of the activations is made. Bit-identical to the cat/neg form."""
    half = x.shape[-1] // 2
    pairs = x.unflatten(-1, (2, half))
    cos = cos.unsqueeze(-2).unflatten(-1, (2, half)).to(x.dtype)  # [.., T, 1, 2, D/2]
    sign = torch.tensor([[-1.0], [1.0]], dtype=x.dtype, device=x.device)  # first half of the swap is negated
    sin = sin.unsqueeze(-2).unflatten(-1, (2, half)).to(x.dtype) * sign
    return (pairs * cos + pairs.flip(-2) * sin).flatten(-2)


class RotateHalf(torch.autograd.Function):
    """``out = x * cos + R(x) * sin`` with ``R([x1, x2]) = [-x2, x1]``, whose gradient is ``g * cos + R^T(g * sin)``,
    ``R^T([g1, g2]) = [g2, -g1]``. Each direction is one multiply into a new tensor and one multiply-add into each
    of its halves (``addcmul_``): two passes over the activations where :func:`rope_formula`'s ops take four
    (mul, flip, mul, add) each way. ``addcmul`` fuses the multiply and the add, so values differ from the formula
    by float rounding only (~1 ulp)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return RotateHalf.rotate(x, cos, sin, sign=-1.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return RotateHalf.rotate(grad, cos, sin, sign=1.0), None, None

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
        """``x * cos`` plus, into the first half, ``sign * x2 * sin1`` and, into the second, ``-sign * x1 * sin2``
        (sign -1: R, the forward; +1: R^T, the backward)."""
        half = x.shape[-1] // 2
        out = x * cos.unsqueeze(-2)  # [.., T, H, D] * [.., T, 1, D]
        sin = sin.unsqueeze(-2)
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=sign)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:], value=-sign)
        return out

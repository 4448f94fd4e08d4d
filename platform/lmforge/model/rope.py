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

    Rotate-half RoPE, ``x * cos + [-x2, x1] * sin``, computed on x viewed as its two halves
    ``[..., 2, D/2]``: the half swap is one ``flip`` and the sign lives in the (small) sin table, so no
    concatenation or negation of the activations is made. Bit-identical to the cat/neg form."""
    half = x.shape[-1] // 2
    pairs = x.unflatten(-1, (2, half))
    cos = cos.unsqueeze(-2).unflatten(-1, (2, half)).to(x.dtype)  # [.., T, 1, 2, D/2]
    sign = torch.tensor([[-1.0], [1.0]], dtype=x.dtype, device=x.device)  # first half of the swap is negated
    sin = sin.unsqueeze(-2).unflatten(-1, (2, half)).to(x.dtype) * sign
    return (pairs * cos + pairs.flip(-2) * sin).flatten(-2)

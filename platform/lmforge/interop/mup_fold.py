"""µP's forward multipliers (model/mup.py) folded into the weights, so a plain Llama/StableLM/MoE class computes
the same logits: both are linear in one weight.

- attention: softmax(q k^T * s) with µP's scale s; HF's classes use 1/sqrt(head_dim). RoPE rotates q linearly
  (rope(c q) = c rope(q)), so q_proj scaled by c = s * sqrt(head_dim) gives the same scores.
- output: logits * 1/m; the untied head's weight scaled by 1/m gives the same logits (µP refuses tied
  embeddings, config/combinations.py, so the embedding table is never touched).
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from lmforge.config.model import ModelConfig
from lmforge.interop.errors import InteropError
from lmforge.model import mup


def fold_mup_multipliers(cfg: ModelConfig, state: Dict[str, Any]) -> Dict[str, Any]:
    """lmforge state dict with µP's multipliers folded in (sp: ``state`` unchanged)."""
    if not mup.is_mup(cfg):
        return state
    if cfg.tie_embeddings:
        raise InteropError(
            "model.parametrization=mup with tied embeddings: the logit multiplier cannot be folded into a shared "
            "table. Fix: train with model.tie_embeddings=false"
        )
    q_factor = mup.attention_scale(cfg) * math.sqrt(cfg.d_model // cfg.n_heads)
    out = dict(state)
    for name, t in state.items():
        if name.endswith(".attention.wq.weight"):
            out[name] = _scaled(t, q_factor)
        elif name == "output.weight":
            out[name] = _scaled(t, mup.output_multiplier(cfg))
    return out


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return (t.float() * factor).to(t.dtype)  # in fp32, then the export's dtype

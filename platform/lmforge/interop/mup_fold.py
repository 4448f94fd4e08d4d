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
    q_factor = _q_factor(cfg)
    out = dict(state)
    for name, t in state.items():
        if name.endswith(".attention.wq.weight"):
            out[name] = _scaled(t, q_factor)
        elif name == "output.weight":
            out[name] = _scaled(t, mup.output_multiplier(cfg))
    return out


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    return (t.float() * factor).to(t.dtype)  # in fp32, then the export's dtype


def fold_note(cfg: ModelConfig) -> str:
    """The export's one line saying what was folded."""
    return (
        f"muP multipliers folded into the weights: q_proj x {_q_factor(cfg):.6g} (attention scale), lm_head x "
        f"{mup.output_multiplier(cfg):.6g} (logit multiplier): the HF model is a standard-parametrization one"
    )


def _q_factor(cfg: ModelConfig) -> float:
    """µP's attention scale over the 1/sqrt(head_dim) the HF classes apply."""
    return mup.attention_scale(cfg) * math.sqrt(cfg.d_model // cfg.n_heads)

"""The dense feed-forward of a block (SwiGLU or GELU) and its hidden width; an MoE layer's shared experts are one
of these (model/moe.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.model import ModelConfig
from lmforge.model.activation import gelu_tanh


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    if cfg.d_ff is not None:
        return cfg.d_ff
    if cfg.mlp == "gelu":
        return 4 * cfg.d_model
    hidden = int(8 * cfg.d_model / 3)
    m = cfg.ffn_multiple_of
    return m * ((hidden + m - 1) // m)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GELU: w2(gelu(w1 x)) (w3 absent)."""

    def __init__(self, cfg: ModelConfig, hidden: Optional[int] = None):
        super().__init__()
        hidden = hidden if hidden is not None else ffn_hidden_dim(cfg)  # an MoE's shared experts pass theirs
        self.gated = cfg.mlp == "swiglu"
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(gelu_tanh(self.w1(x)))

"""The width parametrization (``model.parametrization``): what scales with the width multiplier m.

``sp`` (standard): one init std, one learning rate, attention scale 1/sqrt(head_dim); every function here
returns the neutral value. ``mup``: the Maximal Update Parametrization for Adam of Yang et al. 2022, "Tensor
Programs V: Tuning Large Neural Networks via Zero-Shot Hyperparameter Transfer" (Table 3, the multiplier-free
form with the base shape of its Section 5), with m = d_model / model.mup_base_width. Each parameter has a role,
read from its name alone (so every layout, shard and pipeline part agrees):

    role       parameters                        init std               lr      weight decay
    embedding  tok_embeddings.weight             init_std               lr      wd
    hidden     every other matrix (q/k/v/o,      init_std / sqrt(m)     lr / m  wd * m
               FFN, experts, router)             (residual outputs also / sqrt(2 n_layers))
    output     output.weight (untied)            init_std               lr      wd
    vector     norms and other 1-D tensors       1 / 0                  lr      0

plus two forward multipliers: logits * 1/m (the output head) and the attention scale
sqrt(base head dim) / head_dim (1/head_dim as Tensor Programs V prescribes, scaled to equal SP's
1/sqrt(head_dim) at the base shape; the base head dim is model.mup_base_head_dim, by default mup_base_width /
n_heads). With the logit multiplier the head's effective init std is init_std / m (variance 1/fan_in^2 relative to
the base, Tensor Programs V's readout), so at m = 1 µP is SP exactly. The alternative the paper also allows, a
zero-initialised readout, trained markedly worse in short runs here (validation loss 5.38 against 5.09 after 100
steps at width 64, lr 2^-9, benchmarks/mup_transfer.py's setup).

Weight decay times m keeps AdamW's per-step shrink lr * wd of a hidden matrix independent of width (the
"independent" decay Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", pair with µP); torch's AdamW couples the two.
"""

from __future__ import annotations

import math
from typing import Optional

from lmforge.config.model import ModelConfig

EMBEDDING, HIDDEN, OUTPUT, VECTOR = "embedding", "hidden", "output", "vector"


def is_mup(cfg: ModelConfig) -> bool:
    return cfg.parametrization == "mup"


def width_multiplier(cfg: ModelConfig) -> float:
    """m = d_model / mup_base_width (1 under sp)."""
    return cfg.d_model / cfg.mup_base_width if is_mup(cfg) else 1.0


def param_role(name: str, ndim: int) -> str:
    """The µP role of the parameter with canonical name ``name`` and ``ndim`` dimensions."""
    if ndim < 2 or "norm" in name:
        return VECTOR
    if name.startswith("tok_embeddings."):
        return EMBEDDING
    if name == "output.weight":
        return OUTPUT
    return HIDDEN


def init_std(name: str, ndim: int, cfg: ModelConfig, base_std: float) -> float:
    """The init std of a matrix whose SP std is ``base_std``."""
    if not is_mup(cfg):
        return base_std
    role = param_role(name, ndim)
    if role == HIDDEN:
        return base_std / math.sqrt(width_multiplier(cfg))
    return base_std


def lr_multiplier(name: str, ndim: int, cfg: ModelConfig) -> float:
    """The parameter's learning rate as a multiple of optim.lr."""
    return 1.0 / width_multiplier(cfg) if is_mup(cfg) and param_role(name, ndim) == HIDDEN else 1.0


def weight_decay_multiplier(name: str, ndim: int, cfg: ModelConfig) -> float:
    """The parameter's weight decay as a multiple of optim.weight_decay (vectors get none either way)."""
    return width_multiplier(cfg) if is_mup(cfg) and param_role(name, ndim) == HIDDEN else 1.0


def output_multiplier(cfg: ModelConfig) -> float:
    """What the output head multiplies the logits by: 1/m under µP."""
    return 1.0 / width_multiplier(cfg)


def attention_scale(cfg: ModelConfig) -> Optional[float]:
    """The softmax scale the attention kernels take (``scale=``); None = the kernel's 1/sqrt(head_dim)."""
    if not is_mup(cfg):
        return None
    head_dim = cfg.d_model // cfg.n_heads
    return math.sqrt(base_head_dim(cfg)) / head_dim


def base_head_dim(cfg: ModelConfig) -> float:
    """The base shape's head dimension: model.mup_base_head_dim, or mup_base_width / n_heads (the head count fixed
    across widths)."""
    return cfg.mup_base_head_dim if cfg.mup_base_head_dim is not None else cfg.mup_base_width / cfg.n_heads

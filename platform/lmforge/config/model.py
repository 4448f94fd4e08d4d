"""Schema of the ``model`` config group (``conf/model/*.yaml``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional


@dataclass
class ModelConfig:
    name: str = "smoke"
    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    # None means n_heads (plain multi-head attention); 1 is multi-query; in between is grouped-query.
    n_kv_heads: Optional[int] = None
    # None means the architecture's default width: 4*d for GELU, 8/3*d rounded up to ffn_multiple_of for SwiGLU.
    d_ff: Optional[int] = None
    ffn_multiple_of: int = 64
    # Context length used for training (sequence length of every sample) and the RoPE table size.
    seq_len: int = 256
    mlp: Annotated[str, Literal["swiglu", "gelu"]] = "swiglu"
    norm: Annotated[str, Literal["rmsnorm", "layernorm"]] = "rmsnorm"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    # Standard deviation of the normal init of every weight matrix; output projections of each residual
    # branch are scaled by 1/sqrt(2*n_layers) (GPT-2 / nanoGPT convention).
    init_std: float = 0.02

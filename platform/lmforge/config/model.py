"""Schema of the ``model`` config group (``conf/model/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal, Optional


@dataclass
class MoEConfig:
    """``model.moe``: a Mixture-of-Experts feed-forward in some layers (model/moe.py). ``experts: 0`` (the
    default) is the dense model, unchanged."""

    experts: int = 0  # routed experts per MoE layer; 0 = off (every layer dense)
    top_k: int = 2  # experts each token is sent to
    # Which layers are MoE: the list when given (global layer indices), else every n-th ((i + 1) % n == 0).
    every_n_layers: int = 1
    layers: Optional[List[int]] = None
    shared_experts: int = 0  # always-on experts every token goes through (DeepSeek/Qwen-MoE style)
    d_ff: Optional[int] = None  # width of one expert; None = the dense FFN width (model.d_ff or its default)
    # Gate: softmax over experts (Mixtral, Switch) or independent sigmoids (DeepSeek-V3).
    gating: Annotated[str, Literal["softmax", "sigmoid"]] = "softmax"
    normalize_weights: bool = True  # rescale the chosen top-k gate values to sum to 1
    aux_loss_coef: float = 0.01  # load-balancing loss E * sum_e f_e * P_e (Switch); 0 = off
    z_loss_coef: float = 0.0  # router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0 = off
    # Auxiliary-loss-free balancing (DeepSeek-V3): after each step, bias_e += rate * sign(mean load - load_e);
    # the bias only shifts which experts are chosen, never the gate values. 0 = off.
    bias_update_rate: float = 0.0
    # None = dropless: every assignment is computed. A number: an expert takes at most
    # ceil(capacity_factor * tokens * top_k / experts) assignments per micro batch; the rest are dropped (counted).
    capacity_factor: Optional[float] = None
    # Expert compute, auto: grouped GEMM (torch._grouped_mm) on CUDA when the shapes allow it, the loop on CPU;
    # "loop" forces the per-expert loop (the reference the grouped path is tested against).
    compute: Annotated[str, Literal["auto", "grouped", "loop"]] = "auto"


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
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # built from a plain mapping (a checkpoint's config, asdict round trips)
            self.moe = MoEConfig(**self.moe)

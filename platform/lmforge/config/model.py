"""Schema of the ``model`` config group (``conf/model/*.yaml``).

``ModelConfig()`` holds the architecture's defaults (plain multi-head attention, a 256-token context), named
``custom``: a shape built in code from some of its fields. The presets in ``conf/model/`` are named shapes; the
default composition trains ``smoke`` (``conf/model/smoke.yaml``: these defaults with 2 KV heads and 128 tokens).
Each field's docstring is its meaning (``lmforge config show model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal, Optional

from lmforge.config.ranges import POSITIVE, PositiveInt


@dataclass
class MoEConfig:
    """``model.moe``: a Mixture-of-Experts feed-forward in some layers (model/moe.py). ``experts: 0`` (the
    default) is the dense model, unchanged."""

    experts: int = 0
    """Routed experts per MoE layer; 0 = off (every layer dense), else at least 2."""
    top_k: int = 2
    """Experts each token is sent to."""
    every_n_layers: int = 1
    """Without ``layers``: layer i is an MoE layer when (i + 1) % every_n_layers == 0."""
    layers: Optional[List[int]] = None
    """The MoE layers by global index; null = every ``every_n_layers``-th layer."""
    shared_experts: int = 0
    """Always-on experts every token goes through (DeepSeek/Qwen-MoE style)."""
    d_ff: Optional[int] = None
    """Width of one expert; null = the dense FFN width (model.d_ff or its default)."""
    gating: Annotated[str, Literal["softmax", "sigmoid"]] = "softmax"
    """Gate: softmax over experts (Mixtral, Switch) or independent sigmoids (DeepSeek-V3)."""
    normalize_weights: bool = True
    """Rescale the chosen top-k gate values to sum to 1 (top_k > 1)."""
    aux_loss_coef: float = 0.01
    """Load-balancing loss E * sum_e f_e * P_e (Switch) weight; 0 = off."""
    z_loss_coef: float = 0.0
    """Router z-loss mean(logsumexp(logits)^2) (ST-MoE) weight; 0 = off."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step bias_e += rate * sign(mean load - load_e);
    the bias only shifts which experts are chosen, never the gate values. 0 = off."""
    capacity_factor: Optional[float] = None
    """null = dropless (every assignment computed); a number: an expert takes at most
    ceil(capacity_factor * tokens * top_k / experts) assignments per micro batch, the rest are dropped (counted)."""
    compute: Annotated[str, Literal["auto", "grouped", "loop"]] = "auto"
    """Expert compute: auto = grouped GEMM (torch._grouped_mm) on CUDA when the shapes allow it, the loop on CPU;
    loop forces the per-expert loop (the reference the grouped path is tested against)."""


@dataclass
class ModelConfig:
    name: str = "custom"
    """The shape's name (a conf/model preset's file name; ``custom`` for a shape built in code)."""
    vocab_size: PositiveInt = 8192
    """Embedding rows; at least the tokenizer's vocabulary."""
    d_model: PositiveInt = 256
    """Width of the residual stream."""
    n_layers: PositiveInt = 4
    """Transformer blocks."""
    n_heads: PositiveInt = 4
    """Query heads; the head dim d_model / n_heads must be even (RoPE)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads: null = n_heads (multi-head attention), 1 = multi-query, a divisor in between =
    grouped-query."""
    d_ff: Optional[int] = None
    """MLP width; null = the architecture's default: 4*d for GELU, 8/3*d rounded up to ffn_multiple_of for
    SwiGLU."""
    ffn_multiple_of: PositiveInt = 64
    """The default SwiGLU width is rounded up to a multiple of this."""
    seq_len: PositiveInt = 256
    """Context length of training (the sequence length of every sample) and the RoPE table size."""
    mlp: Annotated[str, Literal["swiglu", "gelu"]] = "swiglu"
    """Feed-forward block."""
    norm: Annotated[str, Literal["rmsnorm", "layernorm"]] = "rmsnorm"
    """Normalisation layer."""
    norm_eps: float = 1e-5
    """Epsilon of the norm layers."""
    rope_theta: float = 10000.0
    """RoPE base."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection (refused with pipeline parallelism)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of every weight matrix; each residual branch's output projection
    is scaled by 1/sqrt(2*n_layers) (GPT-2 / nanoGPT convention)."""
    parametrization: Annotated[str, Literal["sp", "mup"]] = "sp"
    """How initialisation, learning rates and multipliers scale with width. sp: the standard parametrization
    (every matrix N(0, init_std), one learning rate, attention scale 1/sqrt(head_dim)). mup: the Maximal Update
    Parametrization of Yang et al. 2022 ("Tensor Programs V", the Adam table), relative to ``mup_base_width``
    with width multiplier m = d_model / mup_base_width: hidden matrices N(0, init_std / sqrt(m)) with learning
    rate lr / m and weight decay wd * m (lr * wd per step independent of width); embeddings and norms at lr;
    the untied output head N(0, init_std) with its logits multiplied by 1 / m; attention scale
    sqrt(mup_base_head_dim) / head_dim (1/head_dim, equal to SP's at the base shape). model/mup.py;
    needs tie_embeddings=false."""
    mup_base_width: PositiveInt = 256
    """The d_model at which mup equals sp exactly: the width whose tuned
    learning rate and init transfer to every other width."""
    mup_base_head_dim: Annotated[Optional[int], POSITIVE] = None
    """mup's attention scale is sqrt(mup_base_head_dim) / head_dim (1/head_dim, SP's scale at the base shape).
    null = mup_base_width / n_heads: widths grow the head dimension at a fixed head count; set the head dim
    itself when a sweep grows the head count at a fixed head dimension."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts feed-forward (``model.moe.*``; experts 0 = dense)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # built from a plain mapping (a checkpoint's config, asdict round trips)
            self.moe = MoEConfig(**self.moe)

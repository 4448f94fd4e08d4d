"""The one FLOPs formula. Everything that shows FLOPs (MFU, planner, sweeps) calls ``flops_per_token`` (the
MFU of a document-masked run: ``document_flops_per_token``, below).

Training FLOPs per token (forward + backward, no activation recompute counted: this is *model* FLOPs,
the MFU convention of PaLM, nanoGPT, torchtitan):

    6 * N_matmul  +  12 * n_layers * n_heads * head_dim * seq_len

- ``N_matmul`` = parameters that take part in a matrix multiply: every Linear of the blocks and the
  output projection (counted even when tied to the embedding, since the tied weight still multiplies);
  the embedding lookup and norm weights do no matmul and are excluded. In an MoE layer (``model.moe``) only
  the active parameters count: the router, ``top_k`` routed experts and the shared experts (MFU on that
  basis, as torchtitan and Megatron count it; dropped assignments are not subtracted).
- Attention scores: QK^T and AV each cost 2*T*d per token forward (d = n_heads*head_dim), times 3 for
  forward + backward. The **full square is counted** (no causal halving), as torch's FlopCounterMode
  does for SDPA's math kernel; Megatron's newer formula halves it, which lowers its MFU by
  ~ 6*L*d*T / (6N + 12*L*d*T).

Document masking (``data.document_masking``, model/document_mask.py): attention runs within each document
only, so the attention term of a batch is the sum over its documents of their own full squares:

    attention FLOPs (fwd + bwd) = 12 * n_layers * n_heads * head_dim * sum_docs len_doc^2

per token: that / the batch's tokens (``document_flops_per_token``); a sample that is one document gives
the formula above exactly. This is the work a block-skipping kernel does with exact (1 x 1) blocks, the
*model* FLOPs of the masked computation, reported whatever the backend: SDPA with a boolean mask (the
``sdpa`` backend) computes the whole T x T square on CPU, and FlexAttention skips only whole blocks (128 x
128), so the hardware does more than this; counting it would raise MFU for wasted work.
"""

from __future__ import annotations

from lmforge.config.model import ModelConfig
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import kv_heads
from lmforge.model.moe import expert_hidden_dim, moe_layer_ids


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters one token multiplies by: for an MoE layer the *active* ones (router, top_k routed experts and
    the shared experts), not the total (``param_count_from_config``)."""
    d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
    attn = d * cfg.n_heads * hd * 2 + d * kv_heads(cfg) * hd * 2
    mats = 3 if cfg.mlp == "swiglu" else 2
    mlp = d * ffn_hidden_dim(cfg) * mats
    m, n_moe = cfg.moe, len(moe_layer_ids(cfg))
    moe_mlp = d * m.experts + (m.top_k + m.shared_experts) * d * expert_hidden_dim(cfg) * mats
    return cfg.n_layers * (attn + mlp) + n_moe * (moe_mlp - mlp) + cfg.vocab_size * d


def attention_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Forward + backward attention-score FLOPs per token (full T x T square)."""
    t = seq_len if seq_len is not None else cfg.seq_len
    return 12 * cfg.n_layers * cfg.d_model * t


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    """Training (forward + backward) FLOPs per token."""
    return 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def forward_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> int:
    return flops_per_token(cfg, seq_len) // 3


def document_attention_flops(cfg: ModelConfig, square_sum: int) -> int:
    """Forward + backward attention-score FLOPs of a document-masked batch whose documents' length^2 sum to
    ``square_sum`` (``lmforge.model.document_mask.document_square_sum(positions)``)."""
    return 12 * cfg.n_layers * cfg.d_model * square_sum


def document_flops_per_token(cfg: ModelConfig, square_sum: int, tokens: int) -> float:
    """Training FLOPs per token of a document-masked batch of ``tokens`` tokens: the attention of its documents."""
    return 6 * matmul_params(cfg) + document_attention_flops(cfg, square_sum) / tokens

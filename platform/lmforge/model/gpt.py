"""A decoder-only GPT in plain single-device PyTorch, readable top to bottom.

    tokens -> tok_embeddings -> [Block] * n_layers -> norm -> output -> logits
    Block: x = x + attention(attention_norm(x)); x = x + feed_forward(ffn_norm(x))   (pre-norm)

Attention is multi-head, grouped-query or multi-query (``n_kv_heads``), with rotary position embeddings
in the "rotate half" layout (the one Hugging Face's Llama uses, so export needs no q/k permutation) and
``scaled_dot_product_attention(is_causal=True)``, which picks flash kernels on GPU.

Parallelism never lives here: ``lmforge.parallel`` rewrites this module (TP plans, pipeline splits,
FSDP) from the outside. To let it, the layers live in a ``ModuleDict`` keyed by layer index (a pipeline
stage keeps the global names of its layers), head counts are read from the (possibly sharded) weight
shapes at run time, and a stage without embeddings or output simply has them set to ``None``.
"""
from __future__ import annotations


from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.model import ModelConfig


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    if cfg.d_ff is not None:
        return cfg.d_ff
    if cfg.mlp == "gelu":
        return 4 * cfg.d_model
    hidden = int(8 * cfg.d_model / 3)
    m = cfg.ffn_multiple_of
    return m * ((hidden + m - 1) // m)


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape [seq_len, head_dim] in the rotate-half layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.n_rep = cfg.n_heads // kv_heads(cfg)
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_heads(cfg) * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_heads(cfg) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        cos, sin = cos[:seqlen], sin[:seqlen]  # full-length tables (a sequence-parallel block gets T/tp inputs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=2)
            v = v.repeat_interleave(self.n_rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GELU: w2(gelu(w1 x)) (w3 absent)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = ffn_hidden_dim(cfg)
        self.gated = cfg.mlp == "swiglu"
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = make_norm(cfg, cfg.d_model)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg, cfg.d_model)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: Optional[nn.Module] = make_norm(cfg, cfg.d_model)
        self.output: Optional[nn.Linear] = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        # Buffers, not parameters: recomputed by init_weights after meta-device construction.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Set by the pipeline splitter on stages that hold the output but not the (tied) embedding.
        self.tied_output_weight: Optional[nn.Parameter] = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, T] int64 (or hidden states [B, T, d] on a later pipeline stage) -> logits [B, T, V]."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope_cos, self.rope_sin
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None:
            return h
        h = self.norm(h)
        return self.project_to_vocab(h)

    def project_to_vocab(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h)
        weight = self.tok_embeddings.weight if self.tok_embeddings is not None else self.tied_output_weight
        return F.linear(h, weight)

    @torch.no_grad()
    def init_weights(self, seed: int, device: Optional[torch.device] = None, place=None) -> None:
        """Deterministic init keyed by parameter name (see lmforge.model.init)."""
        from lmforge.model.init import init_parameters

        cos, sin = rope_tables(self.cfg.d_model // self.cfg.n_heads, self.cfg.seq_len, self.cfg.rope_theta,
                               device=device or self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin
        init_parameters(self, self.cfg, seed, place)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of a [B, T] batch (computed in fp32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def num_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    n = 0
    for name, p in model.named_parameters():
        if exclude_embeddings and name.startswith("tok_embeddings"):
            continue
        n += p.numel()
    return n


def param_count_from_config(cfg: ModelConfig) -> int:
    """Exact parameter count without building the model."""
    d, kv, hd = cfg.d_model, kv_heads(cfg), cfg.d_model // cfg.n_heads
    hidden = ffn_hidden_dim(cfg)
    norm_params = d if cfg.norm == "rmsnorm" else 2 * d
    attn = d * cfg.n_heads * hd * 2 + d * kv * hd * 2
    mlp = d * hidden * (3 if cfg.mlp == "swiglu" else 2)
    per_layer = attn + mlp + 2 * norm_params
    emb = cfg.vocab_size * d
    out = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return emb + cfg.n_layers * per_layer + norm_params + out



"""A decoder-only GPT in plain single-device PyTorch, readable top to bottom.

    tokens -> tok_embeddings -> [Block] * n_layers -> norm -> output -> logits
    Block: x = x + attention(attention_norm(x)); x = x + feed_forward(ffn_norm(x))   (pre-norm)

Attention is multi-head, grouped-query or multi-query (``n_kv_heads``), with rotary position embeddings
in the "rotate half" layout (the one Hugging Face's Llama uses, so export needs no q/k permutation) and
``scaled_dot_product_attention(is_causal=True)``, which picks flash kernels on GPU.

Parallelism never lives here: ``lmforge.parallel`` rewrites this module (TP plans, FSDP) from the outside
and builds a pipeline rank's part with the constructor (``GPT(cfg, layers, embedding, head)``) and its
stages with ``GPT.stage``. To let it, the layers live in a ``ModuleDict`` keyed by layer index (a pipeline
part keeps the global names of its layers), head counts are read from the (possibly sharded) weight shapes
at run time, and a part without embeddings or head has them set to ``None``.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.model import ModelConfig
from lmforge.model.document_mask import DocumentMask
from lmforge.model.feed_forward import FeedForward, ffn_hidden_dim
from lmforge.model.init import init_parameters
from lmforge.model.loss import chunked_cross_entropy
from lmforge.model.moe import MoEFeedForward, expert_hidden_dim, is_moe_layer, moe_layer_ids
from lmforge.model.mup import attention_scale, output_multiplier
from lmforge.model.rope import apply_rope, rope_tables  # noqa: F401 - part of this module's API


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads if cfg.n_kv_heads is not None else cfg.n_heads


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention over [B, H, T, D] q and [B, H_kv, T, D] k/v (the single-device kernel). Grouped-query:
    SDPA's own grouped path (no repeat_interleave copies of K and V). ``scale``: the softmax scale (None =
    1/sqrt(D); µP passes its own, model/mup.py)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1], scale=scale)


class Attention(nn.Module):
    # The attention kernel over [B, H, T, D]; a context-parallel rank gets its own (parallel/context_parallel.py).
    attend = staticmethod(causal_attention)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.n_rep = cfg.n_heads // kv_heads(cfg)
        self.scale = attention_scale(cfg)  # None = every kernel's 1/sqrt(head_dim); µP: model/mup.py
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_heads(cfg) * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_heads(cfg) * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc: Optional[DocumentMask] = None, kv_cache=None
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        if doc is not None:  # document masking (model/document_mask.py): per-document RoPE positions and mask
            return self.wo(doc.attention(q, k, v, self.n_rep, scale=self.scale))
        if kv_cache is not None:  # decoding (lmforge.generation.kv_cache): RoPE at cached positions, cached K/V
            return self.wo(kv_cache.attend(q, k, v, self.n_rep, scale=self.scale))
        cos, sin = cos[:seqlen], sin[:seqlen]  # full-length tables (a sequence-parallel block gets T/tp inputs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        out = self.attend(q, k, v, scale=self.scale)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = make_norm(cfg, cfg.d_model)
        self.attention = Attention(cfg)
        self.ffn_norm = make_norm(cfg, cfg.d_model)
        # model.moe picks the layers whose FFN is a Mixture of Experts (model/moe.py); the rest stay dense.
        self.feed_forward = MoEFeedForward(cfg) if is_moe_layer(cfg, layer) else FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc: Optional[DocumentMask] = None, kv_cache=None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, doc=doc, kv_cache=kv_cache)
        return x + self.feed_forward(self.ffn_norm(x))


class RotaryTables(nn.Module):
    """The RoPE cos/sin tables, [seq_len, head_dim] each: buffers, not state (recomputed by ``reset``, never
    saved). One instance is shared by a GPT and its pipeline stages, so resetting it reaches every stage."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.seq_len, self.theta = cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_theta
        cos, sin = rope_tables(self.head_dim, self.seq_len, self.theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def reset(self, device: Optional[torch.device] = None) -> None:
        self.cos, self.sin = rope_tables(self.head_dim, self.seq_len, self.theta, device=device or self.cos.device)


class OutputHead(nn.Module):
    """logits = h @ W^T over the vocabulary. Untied, W is the head's own ``weight`` [vocab, d] (``output.weight``,
    initialised like ``nn.Linear``); tied (``model.tie_embeddings``), W is the embedding table, passed in by the
    caller, and the head holds no parameter. Tensor parallelism shards W by vocabulary rows either way
    (``parallel/tensor_parallel.py``'s ``VocabParallelOutput``). µP multiplies the logits by base/width
    (``multiplier``, model/mup.py; 1 under sp, where the product is skipped)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tied = cfg.tie_embeddings
        self.multiplier = output_multiplier(cfg)
        if self.tied:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's init (and its use of the RNG)

    def forward(self, h: torch.Tensor, embedding_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = F.linear(h, embedding_weight if self.tied else self.weight)
        return logits if self.multiplier == 1.0 else logits * self.multiplier


class DecoderStack(nn.Module):
    """The forward of a GPT or of one pipeline stage: ``tok_embeddings`` (absent on a later stage, which takes
    hidden states), the ``layers`` in order, then ``norm`` and ``output`` (absent on an earlier stage, which
    returns hidden states)."""

    tok_embeddings: Optional[nn.Embedding]
    layers: nn.ModuleDict
    norm: Optional[nn.Module]
    output: Optional[OutputHead]
    rope: RotaryTables
    document_attention: str = "sdpa"  # the backend of document-masked forwards (data.document_attention)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        """tokens: [B, T] int64 (or hidden states [B, T, d] on a later pipeline stage) -> logits [B, T, V].
        ``positions`` [B, T]: document-masked attention (model/document_mask.py); None: causal over the sample.
        ``kv_cache`` (decoding only, ``lmforge.generation.KVCache``): attend to the cached tokens too."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cos, sin = self.rope.cos, self.rope.sin
        doc = None if positions is None else self.document_mask(positions)
        for name, layer in self.layers.items():
            if doc is None and kv_cache is None:  # training's path: no extra arguments through the wrappers
                h = layer(h, cos, sin)
            else:
                h = layer(h, cos, sin, doc=doc, kv_cache=None if kv_cache is None else kv_cache.layer(name))
        if self.norm is None:
            return h
        return self.output(self.norm(h), self.tok_embeddings.weight if self.output.tied else None)

    def document_mask(self, positions: torch.Tensor) -> DocumentMask:
        """The mask every layer of a document-masked forward uses (a context-parallel rank's model is given its
        own builder, parallel/context_parallel.py)."""
        return DocumentMask.build(positions, self.rope.cos, self.rope.sin, self.document_attention)


class GPT(DecoderStack):
    """The model, or the part of it one pipeline rank holds: ``layers`` (global indices; default all) keep
    their global names (``layers.5...``), ``embedding`` / ``head`` say whether it holds the token embedding
    and the final norm + output head. Parameter names, and so initialisation and checkpoints, are the same
    for every part."""

    def __init__(
        self, cfg: ModelConfig, layers: Optional[Iterable[int]] = None, embedding: bool = True, head: bool = True
    ):
        super().__init__()
        self.cfg = cfg
        ids = range(cfg.n_layers) if layers is None else layers
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if embedding else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in ids})
        self.norm = make_norm(cfg, cfg.d_model) if head else None
        self.output = OutputHead(cfg) if head else None
        self.rope = RotaryTables(cfg)

    @property
    def rope_cos(self) -> torch.Tensor:
        return self.rope.cos

    @property
    def rope_sin(self) -> torch.Tensor:
        return self.rope.sin

    def stage(self, index: int, layers: Iterable[str], first: bool, last: bool) -> "GPTStage":
        """Pipeline stage ``index`` over this model's ``layers`` (with the embedding if ``first``, the head if
        ``last``): a module sharing this model's submodules, which keeps owning the parameters."""
        return GPTStage(self, index, layers=layers, first=first, last=last)

    @torch.no_grad()
    def init_weights(self, seed: int, device: Optional[torch.device] = None, place=None) -> None:
        """Deterministic init keyed by parameter name (see lmforge.model.init)."""
        self.rope.reset(device)
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.reset_buffers(device)  # the router's balancing bias starts at zero
        init_parameters(self, self.cfg, seed, place)


class GPTStage(DecoderStack):
    """One pipeline stage: consecutive layers of a GPT (a rank's part, built with ``GPT(cfg, layers, ...)``),
    with its embedding on the first stage and its final norm + head on the last. The submodules are the
    GPT's own (the GPT owns the parameters: optimizer, checkpoints and clipping see it); ``PipelineStage``
    runs this module's forward."""

    def __init__(self, model: GPT, index: int, *, layers: Iterable[str], first: bool, last: bool):
        super().__init__()
        self.stage_index = index
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({name: model.layers[name] for name in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.rope = model.rope
        # Document-masked forwards use the part's mask builder (a context-parallel part has its own) and backend.
        self.document_mask = lambda positions: model.document_mask(positions)


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of a [B, T] batch (computed in fp32, chunk by chunk:
    no fp32 copy of the whole logits, model/loss.py); targets -100 are not counted."""
    return chunked_cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


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
    mats = 3 if cfg.mlp == "swiglu" else 2
    mlp = d * hidden * mats
    per_layer = attn + mlp + 2 * norm_params
    emb = cfg.vocab_size * d
    out = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    n_moe = len(moe_layer_ids(cfg))
    m = cfg.moe
    moe_ffn = d * m.experts + (m.experts + m.shared_experts) * d * expert_hidden_dim(cfg) * mats if n_moe else 0
    return emb + cfg.n_layers * per_layer + n_moe * (moe_ffn - mlp) + norm_params + out

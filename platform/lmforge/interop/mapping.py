"""The lmforge <-> Hugging Face mapping: parameter names, config fields, and which architectures fit.

lmforge's attention applies RoPE in the "rotate half" layout (pairs (i, i + head_dim/2)), with the
same frequencies ``theta ** (-2i/head_dim)`` as Hugging Face's Llama/StableLM rotary embedding, so the
q/k projection weights are copied unchanged: there is NO q/k row permutation. (The permutation in
HF's ``convert_llama_weights_to_hf`` exists only for Meta's original checkpoints, which rotate
interleaved pairs (2i, 2i+1).) Grouped-query heads map one to one too: both repeat kv head ``j`` for
query heads ``j*n_rep .. (j+1)*n_rep-1``.

Which HF class fits (docs/interop.md):

    lmforge model.mlp / model.norm   HF architecture          model_type
    swiglu / rmsnorm                 LlamaForCausalLM         llama
    swiglu / layernorm               StableLmForCausalLM      stablelm   (partial_rotary_factor=1, no qkv bias,
                                                                           sequential residual)
    swiglu / rmsnorm, model.moe      MixtralForCausalLM       mixtral    (interop/moe_mapping.py: which MoE
                                     or Qwen2MoeForCausalLM   qwen2_moe   layouts fit, the rest refused)
    gelu   / any                     none: export refuses (a plain GELU MLP with rotary, no biases and GQA
                                     has no exact HF class)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from lmforge.config.model import ModelConfig
from lmforge.interop.errors import InteropError
from lmforge.interop.family import Family
from lmforge.interop.moe_mapping import (
    MOE_FAMILIES,
    moe_config_from_hf,
    moe_family_for,
    moe_hf_config,
    moe_layer_from_hf,
    moe_layer_to_hf,
    moe_qkv_bias,
)
from lmforge.interop.mup_fold import fold_mup_multipliers
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import GPT, kv_heads
from lmforge.model.moe import is_moe_layer, moe_layer_ids

LLAMA = Family("llama", "LlamaForCausalLM", "llama", "rmsnorm", "swiglu", "rms_norm_eps")
STABLELM = Family("stablelm", "StableLmForCausalLM", "stablelm", "layernorm", "swiglu", "layer_norm_eps")
FAMILIES = {f.model_type: f for f in (LLAMA, STABLELM)}

# lmforge per-layer name -> HF per-layer name (without the "layers.{i}." / "model.layers.{i}." prefixes).
_LAYER_MAP = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_MAP_BACK = {v: k for k, v in _LAYER_MAP.items()}
_TOP_MAP_BACK = {v: k for k, v in _TOP_MAP.items()}


def family_for(cfg: ModelConfig) -> Family:
    if cfg.mlp != "swiglu":
        raise InteropError(
            f"model.mlp={cfg.mlp!r}: a plain (un-gated) GELU MLP has no exact Hugging Face equivalent among the "
            "rotary, bias-free, GQA-capable decoder classes (Llama and StableLM use a gated MLP; GPT-NeoX/Phi add "
            "biases, parallel residuals or lack GQA). Fix: export models trained with model.mlp=swiglu "
            "(see docs/interop.md)"
        )
    if cfg.moe.experts:
        return moe_family_for(cfg)
    for fam in FAMILIES.values():
        if fam.norm == cfg.norm and fam.mlp == cfg.mlp:
            return fam
    raise InteropError(
        f"model.norm={cfg.norm!r} with model.mlp={cfg.mlp!r} has no Hugging Face mapping. "
        "Fix: use rmsnorm (Llama) or layernorm (StableLM) with swiglu"
    )


def to_hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        i, rest = parts[1], ".".join(parts[2:])
        stem, leaf = rest.rsplit(".", 1)
        if stem not in _LAYER_MAP:
            raise InteropError(f"lmforge tensor '{name}' has no Hugging Face name")
        return f"model.layers.{i}.{_LAYER_MAP[stem]}.{leaf}"
    stem, leaf = name.rsplit(".", 1)
    if stem not in _TOP_MAP:
        raise InteropError(f"lmforge tensor '{name}' has no Hugging Face name")
    return f"{_TOP_MAP[stem]}.{leaf}"


def _moe_layer(name: str, cfg: ModelConfig) -> Optional[int]:
    """The layer index of an lmforge tensor of an MoE feed-forward, else None."""
    parts = name.split(".")
    if cfg.moe.experts and parts[0] == "layers" and parts[2] == "feed_forward" and is_moe_layer(cfg, int(parts[1])):
        return int(parts[1])
    return None


def to_hf_state(cfg: ModelConfig, state: Dict[str, Any]) -> Dict[str, Any]:
    """lmforge state dict -> HF tensors: µP's multipliers folded in (mup_fold), renamed one to one, MoE layers split
    per expert (moe_mapping)."""

    state = fold_mup_multipliers(cfg, state)
    out: Dict[str, Any] = {}
    moe: Dict[int, Dict[str, Any]] = {}
    for name, t in state.items():
        i = _moe_layer(name, cfg)
        if i is None:
            out[to_hf_name(name)] = t
        else:
            moe.setdefault(i, {})[name.split(".feed_forward.", 1)[1]] = t
    fam = family_for(cfg) if moe else None
    for i, sub in sorted(moe.items()):
        out.update(moe_layer_to_hf(fam, i, sub))
    return out


def from_hf_state(cfg: ModelConfig, hf: Dict[str, Any]) -> Dict[str, Any]:
    """HF tensors (names checked by ``expected_hf_tensors``) -> lmforge state dict (inverse of to_hf_state)."""
    moe = set(moe_layer_ids(cfg))
    fam = family_for(cfg) if moe else None
    out: Dict[str, Any] = {}
    for name, t in hf.items():
        ours = from_hf_name(name)
        if ours is not None:
            out[ours] = t
    for i in sorted(moe):
        out.update(moe_layer_from_hf(cfg, fam, i, hf))
    return out


def from_hf_name(name: str) -> Optional[str]:
    """HF tensor name -> lmforge name, or None if it has no lmforge counterpart."""
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "model" and parts[1] == "layers":
        i, rest = parts[2], ".".join(parts[3:])
        stem, leaf = rest.rsplit(".", 1)
        return f"layers.{i}.{_LAYER_MAP_BACK[stem]}.{leaf}" if stem in _LAYER_MAP_BACK else None
    stem, leaf = name.rsplit(".", 1) if "." in name else (name, "")
    return f"{_TOP_MAP_BACK[stem]}.{leaf}" if stem in _TOP_MAP_BACK else None


def hf_config(cfg: ModelConfig, dtype: str, eod: Optional[int]) -> Dict[str, Any]:
    """config.json for the HF class that fits ``cfg`` (raises InteropError naming the key if none does)."""
    fam = family_for(cfg)
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    out: Dict[str, Any] = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": ffn_hidden_dim(cfg),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": kv_heads(cfg),
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "initializer_range": cfg.init_std,
        fam.eps_key: cfg.norm_eps,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        # transformers >= 5 reads rope_parameters; 4.x reads the top-level rope_theta.
        "rope_parameters": rope,
        "rope_theta": float(cfg.rope_theta),
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": eod,
        "eos_token_id": eod,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.moe.experts:
        out.update(moe_hf_config(cfg, fam))
    elif fam is LLAMA:
        out.update(
            {"head_dim": cfg.d_model // cfg.n_heads, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
        )
    else:
        rope["partial_rotary_factor"] = 1.0
        out.update(
            {
                "partial_rotary_factor": 1.0,
                "use_qkv_bias": False,
                "qk_layernorm": False,
                "use_parallel_residual": False,
                "hidden_dropout": 0.0,
            }
        )
    return out


def _require(hf: Dict[str, Any], key: str, ok: bool, why: str, fix: str) -> None:
    if not ok:
        raise InteropError(f"config.json '{key}'={hf.get(key)!r}: {why}. Fix: {fix}")


def model_config_from_hf(hf: Dict[str, Any], name: str, seq_len: Optional[int] = None) -> ModelConfig:
    """Map a HF Llama/StableLM/Mixtral/Qwen2-MoE config.json onto a ModelConfig, refusing anything lmforge cannot represent."""

    model_type = hf.get("model_type")
    known = {**FAMILIES, **MOE_FAMILIES}
    _require(
        hf,
        "model_type",
        model_type in known,
        f"lmforge imports {', '.join(sorted(known))} checkpoints",
        "convert the checkpoint to a Llama-architecture one first",
    )
    fam = known[model_type]
    moe_fields = moe_config_from_hf(hf, int(hf["num_hidden_layers"])) if model_type in MOE_FAMILIES else {}
    _require(
        hf,
        "qkv_bias",
        not moe_qkv_bias(hf),
        "lmforge attention has no q/k/v biases",
        "import a model with qkv_bias=false",
    )
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    _require(
        hf,
        "hidden_act",
        hf.get("hidden_act", "silu") == "silu",
        "lmforge's gated MLP uses SiLU (SwiGLU)",
        "import a SwiGLU model",
    )
    head_dim = hf.get("head_dim") or hidden // heads
    _require(
        hf,
        "head_dim",
        head_dim * heads == hidden,
        "lmforge derives head_dim = hidden_size / num_attention_heads",
        "import a model whose head_dim * num_attention_heads equals hidden_size",
    )
    for key in ("attention_bias", "mlp_bias", "use_qkv_bias", "qk_layernorm", "use_parallel_residual"):
        _require(
            hf,
            key,
            not hf.get(key, False),
            "lmforge blocks have no biases, q/k norms or parallel residuals",
            "import a model without them",
        )
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _require(
        hf,
        "rope_parameters",
        rope_type == "default",
        f"rope_type {rope_type!r} (scaled RoPE) is not implemented by lmforge",
        "import a model with plain RoPE",
    )
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25 if fam is STABLELM else 1.0))
    _require(
        hf,
        "partial_rotary_factor",
        float(partial) == 1.0,
        "lmforge rotates the whole head",
        "import a model with full rotary embeddings",
    )
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kv = int(hf.get("num_key_value_heads") or heads)
    return ModelConfig(
        name=name,
        vocab_size=int(hf["vocab_size"]),
        d_model=hidden,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=int(moe_fields.get("d_ff", hf["intermediate_size"])),
        seq_len=int(seq_len or hf.get("max_position_embeddings", 2048)),
        mlp="swiglu",
        norm=fam.norm,
        norm_eps=float(hf.get(fam.eps_key, 1e-5)),
        rope_theta=float(theta),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **({"moe": moe_fields["moe"]} if moe_fields else {}),
    )


def expected_hf_tensors(cfg: ModelConfig) -> Dict[str, Tuple[int, ...]]:
    """{HF name: shape} of every tensor the HF checkpoint of ``cfg`` holds (tied models have no lm_head)."""
    import torch

    with torch.device("meta"):
        model = GPT(cfg)
    return {n: tuple(t.shape) for n, t in to_hf_state(cfg, model.state_dict()).items()}


def describe(problems: List[str], limit: int = 30) -> str:
    shown = problems[:limit]
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(shown) + more

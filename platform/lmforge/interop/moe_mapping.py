"""The Mixture-of-Experts part of the lmforge <-> Hugging Face mapping (model/moe.py <-> Mixtral, Qwen2-MoE).

Which HF class an MoE model exports to (the first that is exact; anything neither represents is refused with
one line naming the key):

    MixtralForCausalLM   every layer MoE, no shared experts, top_k >= 2 with normalize_weights (Mixtral always
                         renormalises the chosen top-k softmax probabilities)
    Qwen2MoeForCausalLM  any MoE layer set (mlp_only_layers = the dense layers, decoder_sparse_step 1), shared
                         experts (one shared MLP of shared_experts x the expert width), norm_topk_prob =
                         normalize_weights and top_k > 1, qkv_bias false

Both route by a softmax over the experts and pick the top-k of it, as ``gating=softmax`` does; ``sigmoid`` gating
has no counterpart and is refused. The aux-loss-free ``expert_bias`` shifts which experts are chosen and neither
HF router has it: a checkpoint whose bias is non-zero is refused (its HF logits would differ), a zero one is
dropped. Qwen2-MoE gates its shared expert by ``sigmoid(shared_expert_gate(x))``; lmforge's shared experts are
ungated, which maps exactly as a zero gate (sigmoid(0) = 0.5, exact in floating point) with the shared
``down_proj`` doubled; import halves it again and refuses a non-zero gate. The capacity limit is a training-time
bound: both HF classes are dropless, which export announces when ``capacity_factor`` is set.

Tensor layout: lmforge stacks the experts (``w1``/``w3`` [E, d, h], ``w2`` [E, h, d], used as ``x @ w[e]``); the
HF checkpoints hold one ``nn.Linear`` weight per expert ([h, d] and [d, h]: the transposes), the per-expert
layout transformers writes itself and fuses on load.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from lmforge.config.model import ModelConfig, MoEConfig
from lmforge.interop.errors import InteropError
from lmforge.interop.family import Family
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.moe import expert_hidden_dim, is_moe_layer, moe_layer_ids

MIXTRAL = Family("mixtral", "MixtralForCausalLM", "mixtral", "rmsnorm", "swiglu", "rms_norm_eps")
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", "rmsnorm", "swiglu", "rms_norm_eps")
MOE_FAMILIES = {f.model_type: f for f in (MIXTRAL, QWEN2_MOE)}

# the routed experts: lmforge stacked weight -> (Mixtral name, Qwen2-MoE name) of expert j's Linear weight
_EXPERT_NAMES = {"w1": ("w1", "gate_proj"), "w3": ("w3", "up_proj"), "w2": ("w2", "down_proj")}
_SHARED_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def moe_family_for(cfg: ModelConfig) -> Family:
    """Mixtral when it is exact, else Qwen2-MoE; refuses (one line naming the key) what neither represents."""
    m = cfg.moe
    if cfg.norm != "rmsnorm":
        raise InteropError(
            f"model.norm={cfg.norm!r} with model.moe.experts={m.experts}: the Hugging Face MoE "
            "classes (Mixtral, Qwen2-MoE) use RMSNorm. Fix: train MoE models with model.norm=rmsnorm"
        )
    if m.gating != "softmax":
        raise InteropError(
            f"model.moe.gating={m.gating!r}: Mixtral and Qwen2-MoE route by a softmax over the "
            "experts; sigmoid gating (DeepSeek-V3) has no exact Hugging Face class here. Fix: export "
            "models trained with model.moe.gating=softmax"
        )
    normalized = m.normalize_weights and m.top_k > 1
    every_layer = len(moe_layer_ids(cfg)) == cfg.n_layers
    if m.shared_experts == 0 and every_layer and normalized:
        return MIXTRAL
    return QWEN2_MOE


def moe_hf_config(cfg: ModelConfig, fam: Family) -> Dict[str, Any]:
    """The MoE fields of config.json (merged over the Llama-style fields by ``mapping.hf_config``)."""
    m: MoEConfig = cfg.moe
    h = expert_hidden_dim(cfg)
    common = {
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": False,
        "sliding_window": None,
        "head_dim": cfg.d_model // cfg.n_heads,
    }
    if fam is MIXTRAL:
        return {**common, "num_local_experts": m.experts, "intermediate_size": h, "router_jitter_noise": 0.0}
    return {
        **common,
        "num_experts": m.experts,
        "intermediate_size": ffn_hidden_dim(cfg),
        "moe_intermediate_size": h,
        "shared_expert_intermediate_size": m.shared_experts * h,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.n_layers) if not is_moe_layer(cfg, i)],
        "norm_topk_prob": bool(m.normalize_weights and m.top_k > 1),
        "qkv_bias": False,
        "use_sliding_window": False,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


def export_notes(cfg: ModelConfig) -> List[str]:
    if cfg.moe.experts and cfg.moe.capacity_factor is not None:
        return [
            f"model.moe.capacity_factor={cfg.moe.capacity_factor}: the Hugging Face model is dropless (it computes "
            "every assignment); lmforge's forward drops assignments beyond the capacity, so logits can differ "
            "where an expert overflows"
        ]
    return []


def refuse_router_bias(state: Dict[str, torch.Tensor]) -> None:
    """A non-zero aux-loss-free bias changes which experts are chosen; no HF MoE router has one."""
    for name, t in state.items():
        if name.endswith("router.expert_bias") and torch.count_nonzero(t):
            raise InteropError(
                f"{name} is non-zero (max |bias| {t.abs().max().item():.3g}, from "
                "model.moe.bias_update_rate > 0): it shifts which experts are chosen and the Mixtral / "
                "Qwen2-MoE routers have no such bias, so the exported logits would differ. Fix: export "
                "a model balanced by the aux loss (model.moe.bias_update_rate=0)"
            )


def _hf_prefix(fam: Family, i: int) -> str:
    return f"model.layers.{i}." + ("block_sparse_moe." if fam is MIXTRAL else "mlp.")


def moe_layer_to_hf(fam: Family, i: int, sub: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Layer ``i``'s lmforge feed_forward tensors (names after ``feed_forward.``) -> its HF tensors."""
    pre, q = _hf_prefix(fam, i), fam is QWEN2_MOE
    out = {pre + "gate.weight": sub["router.gate.weight"]}
    for ours, names in _EXPERT_NAMES.items():
        stacked = sub[f"experts.{ours}"]
        for j in range(stacked.shape[0]):
            out[f"{pre}experts.{j}.{names[q]}.weight"] = stacked[j].t().contiguous()
    if q:
        d = sub["router.gate.weight"].shape[1]
        has_shared = "shared.w1.weight" in sub
        like = sub["router.gate.weight"]
        for ours, theirs in _SHARED_NAMES.items():
            w = sub.get(f"shared.{ours}.weight")
            if w is None:  # no shared experts: a zero-width shared MLP
                w = like.new_zeros((d, 0) if ours == "w2" else (0, d))
            out[f"{pre}shared_expert.{theirs}.weight"] = w * 2 if ours == "w2" and has_shared else w
        out[f"{pre}shared_expert_gate.weight"] = like.new_zeros((1, d))
    return out


def moe_layer_from_hf(cfg: ModelConfig, fam: Family, i: int, hf: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Layer ``i``'s HF MoE tensors -> lmforge ``layers.{i}.feed_forward.*`` tensors (inverse of moe_layer_to_hf)."""
    pre, q, ours_pre = _hf_prefix(fam, i), fam is QWEN2_MOE, f"layers.{i}.feed_forward."
    out = {
        ours_pre + "router.gate.weight": hf[pre + "gate.weight"],
        ours_pre + "router.expert_bias": torch.zeros(cfg.moe.experts, dtype=torch.float32),
    }
    for ours, names in _EXPERT_NAMES.items():
        out[f"{ours_pre}experts.{ours}"] = torch.stack(
            [hf[f"{pre}experts.{j}.{names[q]}.weight"].t() for j in range(cfg.moe.experts)]
        ).contiguous()
    if q:
        gate = hf[pre + "shared_expert_gate.weight"]
        if torch.count_nonzero(gate):
            raise InteropError(
                f"{pre}shared_expert_gate.weight is non-zero: lmforge's shared experts are ungated (a "
                "zero gate, sigmoid(0) = 0.5, is the only one it represents). Fix: import a Qwen2-MoE "
                "checkpoint exported by lmforge, or one whose shared expert gate is zero"
            )
        if cfg.moe.shared_experts:
            for ours, theirs in _SHARED_NAMES.items():
                w = hf[f"{pre}shared_expert.{theirs}.weight"]
                out[f"{ours_pre}shared.{ours}.weight"] = w / 2 if ours == "w2" else w
    return out


def _need(hf: Dict[str, Any], key: str, ok: bool, why: str, fix: str) -> None:
    if not ok:
        raise InteropError(f"config.json '{key}'={hf.get(key)!r}: {why}. Fix: {fix}")


def moe_config_from_hf(hf: Dict[str, Any], n_layers: int) -> Dict[str, Any]:
    """The ModelConfig fields (``d_ff`` and ``moe``) of a Mixtral / Qwen2-MoE config.json; refuses what lmforge
    cannot represent, naming the key."""
    fam = MOE_FAMILIES[hf["model_type"]]
    window = (
        hf.get("sliding_window")
        if fam is MIXTRAL
        else (hf.get("sliding_window") if hf.get("use_sliding_window") else None)
    )
    _need(
        hf,
        "sliding_window",
        window is None,
        "lmforge attention is full causal attention",
        "import a model without sliding-window attention",
    )
    top_k = int(hf.get("num_experts_per_tok", 2))
    aux = {"aux_loss_coef": float(hf["router_aux_loss_coef"])} if "router_aux_loss_coef" in hf else {}
    if fam is MIXTRAL:
        h = int(hf["intermediate_size"])
        _need(
            hf,
            "num_experts_per_tok",
            top_k > 1,
            "Mixtral renormalises a single chosen expert to weight 1; lmforge "
            "keeps the softmax probability with top_k=1",
            "import a top-2 (or more) Mixtral",
        )
        moe = MoEConfig(experts=int(hf["num_local_experts"]), top_k=top_k, d_ff=h, normalize_weights=True, **aux)
        return {"d_ff": h, "moe": moe}
    h, shared = int(hf["moe_intermediate_size"]), int(hf.get("shared_expert_intermediate_size", 0))
    _need(
        hf,
        "shared_expert_intermediate_size",
        shared % h == 0,
        f"lmforge's shared experts are a whole number of experts wide (moe_intermediate_size={h})",
        "import a model whose shared expert width is a multiple of it",
    )
    normalize = bool(hf.get("norm_topk_prob", False))
    _need(
        hf,
        "norm_topk_prob",
        not (normalize and top_k == 1),
        "with top_k=1 lmforge keeps the softmax probability (no renormalisation)",
        "import a model with norm_topk_prob=false or top_k > 1",
    )
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
    layers = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    _need(
        hf,
        "num_experts",
        int(hf.get("num_experts", 0)) > 1 and bool(layers),
        "no MoE layer (lmforge imports a dense model as Llama)",
        "convert it to a Llama checkpoint",
    )
    placement = dict(every_n_layers=step) if not dense else dict(layers=layers)
    moe = MoEConfig(
        experts=int(hf["num_experts"]),
        top_k=top_k,
        d_ff=h,
        shared_experts=shared // h,
        normalize_weights=normalize,
        **placement,
        **aux,
    )
    return {"d_ff": int(hf["intermediate_size"]), "moe": moe}


def moe_qkv_bias(hf: Dict[str, Any]) -> Optional[bool]:
    """Qwen2-MoE's attention has q/k/v biases unless ``qkv_bias`` is false (its default is true)."""
    return bool(hf.get("qkv_bias", True)) if hf.get("model_type") == QWEN2_MOE.model_type else None

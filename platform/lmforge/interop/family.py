"""A Hugging Face architecture family lmforge maps onto (Llama, StableLM in interop/mapping.py; Mixtral, Qwen2-MoE
in interop/moe_mapping.py): its class names and the lmforge ``model.norm`` / ``model.mlp`` it corresponds to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    model_type: str
    norm: str  # lmforge model.norm
    mlp: str  # lmforge model.mlp
    eps_key: str  # HF config key of the norm epsilon

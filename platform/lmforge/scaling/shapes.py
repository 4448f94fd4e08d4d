"""Model-shape families for sweeps: depth -> width -> heads rules, sized with the project's FLOPs function.

Rule: every depth L in [min_layers, max_layers] and every width d_model that is a multiple of head_dim with

    aspect_min <= d_model / L <= aspect_max                         (width grows with depth)
    n_heads  = d_model / head_dim                                   (fixed head size)
    n_kv     = max(1, n_heads // kv_group)                          (kv_group=1: multi-head attention)

is a candidate; the planner then keeps the candidates whose tokens per parameter fit the budget and spreads
its sizes evenly in ln N (at equal N the shape whose aspect ratio is nearest the geometric middle wins).

Sizes are reported three ways (all exact, from the config, no model built):
    n_params  = lmforge.model.gpt.param_count_from_config            (every parameter, embeddings included)
    n_flops   = flops_per_token / 6                                  (FLOP-equivalent size: C = 6 * n_flops * D exactly)
    n_matmul  = lmforge.model.flops.matmul_params                    (weights that multiply; non-embedding + head)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List

from lmforge.config.model import ModelConfig
from lmforge.model.flops import flops_per_token, matmul_params
from lmforge.model.gpt import param_count_from_config
from lmforge.scaling.errors import ScalingError


@dataclass
class ShapeFamily:
    head_dim: int = 64
    aspect_min: float = 32.0  # d_model per layer, lower bound
    aspect_max: float = 128.0  # d_model per layer, upper bound
    max_width: int = 16384  # largest d_model considered
    min_layers: int = 2
    max_layers: int = 48
    kv_group: int = 1
    vocab_size: int = 50304
    seq_len: int = 2048
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    tie_embeddings: bool = False
    ffn_multiple_of: int = 64

    def check(self) -> "ShapeFamily":
        for key in (
            "head_dim",
            "max_width",
            "min_layers",
            "max_layers",
            "kv_group",
            "vocab_size",
            "seq_len",
            "ffn_multiple_of",
        ):
            if getattr(self, key) < 1:
                raise ScalingError(f"family.{key}", f"must be >= 1, got {getattr(self, key)}", "set a positive value")
        if self.head_dim % 2:
            raise ScalingError(
                "family.head_dim", f"{self.head_dim} is odd; RoPE needs an even head size", "use e.g. 16 or 64"
            )
        if self.max_layers < self.min_layers:
            raise ScalingError(
                "family.max_layers",
                f"{self.max_layers} < min_layers {self.min_layers}",
                "raise max_layers or lower min_layers",
            )
        if not 0 < self.aspect_min <= self.aspect_max:
            raise ScalingError(
                "family.aspect_min",
                f"need 0 < aspect_min <= aspect_max, got {self.aspect_min}..{self.aspect_max}",
                "e.g. aspect_min=32, aspect_max=128 (d_model per layer)",
            )
        return self

    def model_config(self, n_layers: int, d: int) -> ModelConfig:
        heads = d // self.head_dim
        return ModelConfig(
            name=f"l{n_layers}-d{d}",
            vocab_size=self.vocab_size,
            d_model=d,
            n_layers=n_layers,
            n_heads=heads,
            n_kv_heads=max(1, heads // self.kv_group),
            seq_len=self.seq_len,
            mlp=self.mlp,
            norm=self.norm,
            tie_embeddings=self.tie_embeddings,
            ffn_multiple_of=self.ffn_multiple_of,
        )

    def shapes(self) -> List["Shape"]:
        """All candidate shapes, sorted by FLOP-equivalent size."""
        self.check()
        out: List[Shape] = []
        for layers in range(self.min_layers, self.max_layers + 1):
            k_lo = max(1, math.ceil(self.aspect_min * layers / self.head_dim - 1e-9))
            k_hi = min(math.floor(self.aspect_max * layers / self.head_dim + 1e-9), self.max_width // self.head_dim)
            out += [Shape.of(self.model_config(layers, k * self.head_dim)) for k in range(k_lo, k_hi + 1)]
        if not out:
            raise ScalingError(
                "family",
                f"no (depth, width) satisfies aspect {self.aspect_min:g}..{self.aspect_max:g} "
                f"with head_dim {self.head_dim} and layers {self.min_layers}..{self.max_layers}",
                "widen the aspect range or lower head_dim",
            )
        mid = math.sqrt(self.aspect_min * self.aspect_max)
        out.sort(key=lambda s: (s.n_flops, abs(math.log(s.model.d_model / s.model.n_layers / mid))))
        return out

    def as_dict(self) -> Dict:
        return asdict(self)


@dataclass
class Shape:
    model: ModelConfig
    n_params: int
    n_flops: float
    n_matmul: int
    flops_per_token: int

    @staticmethod
    def of(cfg: ModelConfig) -> "Shape":
        fpt = flops_per_token(cfg)
        return Shape(cfg, param_count_from_config(cfg), fpt / 6.0, matmul_params(cfg), fpt)

    def model_overrides(self) -> List[str]:
        m = self.model
        return [
            f"model.name={m.name}",
            f"model.vocab_size={m.vocab_size}",
            f"model.d_model={m.d_model}",
            f"model.n_layers={m.n_layers}",
            f"model.n_heads={m.n_heads}",
            f"model.n_kv_heads={m.n_kv_heads}",
            f"model.seq_len={m.seq_len}",
            f"model.mlp={m.mlp}",
            f"model.norm={m.norm}",
            f"model.tie_embeddings={str(m.tie_embeddings).lower()}",
            f"model.ffn_multiple_of={m.ffn_multiple_of}",
            "model.d_ff=null",
        ]

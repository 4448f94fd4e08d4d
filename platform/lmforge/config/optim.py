"""Schema of the ``optim`` config group (``conf/optim/*.yaml``): optimizer and learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional


@dataclass
class OptimConfig:
    name: Annotated[str, Literal["adamw"]] = "adamw"
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # final LR = lr * min_lr_ratio
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    schedule: Annotated[str, Literal["cosine", "wsd", "constant"]] = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: fraction of max_steps spent in the final decay
    fused: Optional[bool] = None  # None: fused AdamW where the device supports it

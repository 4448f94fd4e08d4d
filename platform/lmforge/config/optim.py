"""Schema of the ``optim`` config group (``conf/optim/*.yaml``): optimizer and learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional

from lmforge.config.ranges import NonNegativeFloat, NonNegativeInt, Range


@dataclass
class OptimConfig:
    name: Annotated[str, Literal["adamw"]] = "adamw"
    """The optimizer (and its conf/optim preset)."""
    lr: NonNegativeFloat = 3e-4
    """Peak learning rate, reached after warmup."""
    min_lr_ratio: Annotated[float, Range(0, 1, fix="e.g. 0.1")] = 0.1
    """Final learning rate = lr * min_lr_ratio (cosine and wsd), in [0, 1]."""
    weight_decay: NonNegativeFloat = 0.1
    """Decoupled weight decay of the weight matrices (embeddings, norms and biases get none)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: NonNegativeFloat = 1e-8
    """AdamW epsilon."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    schedule: Annotated[str, Literal["cosine", "wsd", "constant"]] = "cosine"
    """Learning-rate schedule after warmup: cosine decay, warmup-stable-decay, or constant."""
    warmup_steps: NonNegativeInt = 100
    """Linear warmup steps from 0 to lr."""
    decay_fraction: float = 0.2
    """wsd: the fraction of max_steps spent in the final decay (when decay_steps is 0)."""
    decay_steps: NonNegativeInt = 0
    """wsd: the final decay's length in steps; 0 = decay_fraction of train.max_steps. A cooldown branch resumes a
    stable run's checkpoint at step s (train.resume=<its step dir>) with train.max_steps=s+decay_steps."""
    decay_shape: Annotated[str, Literal["linear", "1-sqrt", "cosine"]] = "linear"
    """wsd: the decay's shape from lr to the floor: linear, 1-sqrt (1 - sqrt(progress), Hagele et al. 2024's best
    cooldown), or cosine (a half cosine)."""
    fused: Optional[bool] = None
    """Fused AdamW kernel; null = fused where the device supports it (CUDA, CPU), foreach elsewhere."""

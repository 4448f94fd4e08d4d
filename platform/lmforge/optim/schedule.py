"""The learning-rate schedules, as a multiplier of ``optim.lr`` (step s in [0, max_steps), warmup W, floor
lr*min_lr_ratio):

- cosine:   linear warmup to lr over W steps, then cosine to the floor at max_steps.
- wsd:      warmup, stable at lr, then linear decay to the floor over the last decay_fraction of steps.
- constant: warmup, then lr.
"""

from __future__ import annotations

import math

from lmforge.config.optim import OptimConfig


def lr_multiplier(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of cfg.lr applied for the update of ``step`` (0-based)."""
    warm = cfg.warmup_steps
    if warm > 0 and step < warm:
        return (step + 1) / warm
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, max_steps - warm)
        progress = min(1.0, (step - warm) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd
    decay_steps = max(1, int(round(cfg.decay_fraction * max_steps)))
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return 1.0 - (1.0 - floor) * progress

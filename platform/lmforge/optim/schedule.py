"""The learning-rate schedules, as a multiplier of ``optim.lr`` (step s in [0, max_steps), warmup W, floor
lr*min_lr_ratio):

- cosine:   linear warmup to lr over W steps, then cosine to the floor at max_steps.
- wsd:      warmup, stable at lr, then a decay to the floor over the last decay_steps steps (or decay_fraction
            of max_steps), linear, 1-sqrt or cosine in shape (Hagele et al. 2024, "Scaling Laws and Compute-Optimal
            Training Beyond Fixed Training Durations"). Until the decay the multiplier does not depend on
            max_steps, so a cooldown branch (a stable run's checkpoint at step s, resumed with max_steps=s+decay_steps)
            takes exactly the steps a run planned for s+decay_steps from the start would.
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
    decay_steps = wsd_decay_steps(cfg, max_steps)
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return floor + (1.0 - floor) * DECAY_SHAPES[cfg.decay_shape](progress)


# wsd's decay: the share of (lr - floor) left at progress p in (0, 1] of the decay
DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def wsd_decay_steps(cfg: OptimConfig, max_steps: int) -> int:
    """wsd's decay length: ``optim.decay_steps``, or ``decay_fraction`` of ``max_steps`` (at least one step)."""
    if cfg.decay_steps > 0:
        return cfg.decay_steps
    return max(1, int(round(cfg.decay_fraction * max_steps)))

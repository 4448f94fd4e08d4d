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
    return lr_multiplier_at(step, step + 1, 1, cfg, max_steps=max_steps)


def lr_multiplier_at(before: int, after: int, unit: int, cfg: OptimConfig, *, max_steps: int) -> float:
    """Multiplier of cfg.lr for the update that moves the run from ``before`` to ``after`` samples, the schedule's
    step keys counting ``unit`` samples each (a full batch). ``lr_multiplier(step)`` is this with unit 1 (one step);
    under a batch ramp (config/batch_ramp.py) the trainer passes the step's samples and unit = global batch, so the
    LR follows the samples seen: the same LR per token for any data-parallel size and any resume. Every ratio is of
    whole numbers, so for a constant batch the result is bit-identical to the per-step form."""
    warm = cfg.warmup_steps
    if warm > 0 and before < warm * unit:
        return after / (warm * unit)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, max_steps - warm)
        progress = min(1.0, (before - warm * unit) / (span * unit))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd
    decay_steps = wsd_decay_steps(cfg, max_steps)
    decay_start = max_steps - decay_steps
    if before < decay_start * unit:
        return 1.0
    progress = min(1.0, (after - decay_start * unit) / (decay_steps * unit))
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

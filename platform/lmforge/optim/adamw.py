"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedules.

Schedules (step s in [0, max_steps), warmup W, peak lr, floor lr*min_lr_ratio):
- cosine:   linear warmup to lr over W steps, then cosine to the floor at max_steps.
- wsd:      warmup, stable at lr, then linear decay to the floor over the last decay_fraction of steps.
- constant: warmup, then lr.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

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


def param_groups(named_params: Iterable, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    groups = param_groups(model.named_parameters(), cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if fused:
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def build_optimizer_from_dict(model: torch.nn.Module, optim: dict) -> torch.optim.Optimizer:
    """The optimizer of a saved config (a checkpoint sidecar's ``config.optim``), on the CPU."""
    fields = {k: v for k, v in optim.items() if k in OptimConfig.__dataclass_fields__}
    return build_optimizer(model, OptimConfig(**fields), torch.device("cpu"))

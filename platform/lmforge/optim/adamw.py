"""``optim=adamw``: torch's AdamW with decoupled weight decay on matrices only (norms and vectors get none)."""

from __future__ import annotations

from typing import Iterable

import torch

from lmforge.config.optim import OptimConfig


def param_groups(named_params: Iterable, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "norm" not in name else no_decay).append(p)
    return [
        {"params": kind, "weight_decay": wd}
        for params, wd in ((decay, weight_decay), (no_decay, 0.0))
        for kind in _by_tensor_kind(params)
    ]


def _by_tensor_kind(params: list) -> list[list]:
    """The fused / foreach kernels refuse a list mixing DTensors and plain tensors, which tensor parallelism
    gives an MoE model (replicated experts and router are plain, model/moe.py): such a group is split in two.
    Every other layout keeps one group each (the same optimizer state layout as before)."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [sharded, plain] if sharded and plain else [params]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    # Fused AdamW (one kernel over all tensors) is torch's fastest on CUDA and on CPU: on the CPU, 5x the
    # foreach step at model=bench_small (benchmarks/reports/2026-12-step-speed.md); other devices get foreach.
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    groups = param_groups(model.named_parameters(), cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if fused:
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


def build_optimizer_from_dict(model: torch.nn.Module, optim: dict) -> torch.optim.Optimizer:
    """The optimizer of a saved config (a checkpoint sidecar's ``config.optim``), on the CPU."""
    fields = {k: v for k, v in optim.items() if k in OptimConfig.__dataclass_fields__}
    return build_optimizer(model, OptimConfig(**fields), torch.device("cpu"))

"""``optim=adamw``: torch's AdamW with decoupled weight decay on matrices only (norms and vectors get none); under
``model.parametrization=mup`` per-group learning-rate and weight-decay multipliers (model/mup.py)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from lmforge.config.model import ModelConfig
from lmforge.config.optim import OptimConfig
from lmforge.model import mup
from lmforge.model.init import canonical_name


def param_groups(named_params: Iterable, weight_decay: float, model_cfg: Optional[ModelConfig] = None) -> list[dict]:
    """The AdamW groups, chosen from each parameter's (canonical) name and rank alone, so every layout (FSDP, TP,
    PP, EP shards and pipeline parts) builds the same groups. Standard parametrization: decay (matrices) and no
    decay. ``model.parametrization=mup``: one group per (lr multiplier, weight decay) of model/mup.py's roles,
    each carrying its ``lr_mult`` (the engines set a group's lr to the scheduled lr times it)."""
    if model_cfg is not None and mup.is_mup(model_cfg):
        return _mup_groups(named_params, weight_decay, model_cfg)
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


def _mup_groups(named_params: Iterable, weight_decay: float, cfg: ModelConfig) -> list[dict]:
    by_hyper: dict = {}  # (lr_mult, weight_decay) -> params, in first-seen order
    for name, p in named_params:
        if not p.requires_grad:
            continue
        name, ndim = canonical_name(name), p.ndim
        vector = mup.param_role(name, ndim) == mup.VECTOR
        wd = 0.0 if vector else weight_decay * mup.weight_decay_multiplier(name, ndim, cfg)
        by_hyper.setdefault((mup.lr_multiplier(name, ndim, cfg), wd), []).append(p)
    return [
        {"params": kind, "weight_decay": wd, "lr_mult": lr_mult}
        for (lr_mult, wd), params in by_hyper.items()
        for kind in _by_tensor_kind(params)
    ]


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The scheduled lr on every group, times the group's ``lr_mult`` (µP; 1 for groups without one)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def _by_tensor_kind(params: list) -> list[list]:
    """The fused / foreach kernels refuse a list mixing DTensors and plain tensors, which tensor parallelism
    gives an MoE model (replicated experts and router are plain, model/moe.py): such a group is split in two.
    Every other layout keeps one group each (the same optimizer state layout as before)."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [sharded, plain] if sharded and plain else [params]


def build_optimizer(
    model: torch.nn.Module, cfg: OptimConfig, device: torch.device, model_cfg: Optional[ModelConfig] = None
) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters; ``model_cfg`` (the model's config) picks µP's groups if it asks for them."""
    # Fused AdamW (one kernel over all tensors) is torch's fastest on CUDA and on CPU: on the CPU, 5x the
    # foreach step at model=bench_small (benchmarks/reports/2026-12-step-speed.md); other devices get foreach.
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    groups = param_groups(model.named_parameters(), cfg.weight_decay, model_cfg)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if fused:
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    optimizer = torch.optim.AdamW(groups, **kwargs)
    set_learning_rate(optimizer, cfg.lr)  # the groups' µP multipliers from the start, as every step sets them
    return optimizer


def build_optimizer_from_dict(model: torch.nn.Module, optim: dict) -> torch.optim.Optimizer:
    """The optimizer of a saved config (a checkpoint sidecar's ``config.optim``), on the CPU."""
    fields = {k: v for k, v in optim.items() if k in OptimConfig.__dataclass_fields__}
    return build_optimizer(model, OptimConfig(**fields), torch.device("cpu"), model.cfg)

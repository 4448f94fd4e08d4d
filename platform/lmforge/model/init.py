"""Deterministic initialisation keyed by parameter name and seed.

Every parameter gets its own CPU generator seeded from (seed, fully qualified name), so the starting
weights are identical however the model is later split (pipeline stages keep global names), sharded
(FSDP/TP shards copy their slice of the full tensor) or constructed (eager or on the meta device).

Scheme (GPT-2 / nanoGPT style): every weight matrix ~ N(0, init_std); the output projection of each
residual branch (``attention.wo``, ``feed_forward.w2``) ~ N(0, init_std / sqrt(2 * n_layers)); norm
weights 1, norm biases 0. ``model.parametrization=mup`` rescales the std by the parameter's role
(model/mup.py: hidden matrices / sqrt(width multiplier)).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Optional

import torch
from torch import nn

from lmforge.config.model import ModelConfig
from lmforge.model import mup

RESIDUAL_OUTPUTS = (
    "attention.wo.weight",
    "feed_forward.w2.weight",
    "feed_forward.experts.w2",
    "feed_forward.shared.w2.weight",
)  # MoE (model/moe.py)


def param_seed(seed: int, name: str) -> int:
    return (zlib.crc32(name.encode()) * 1_000_003 + seed) % (2**63 - 1)


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The parameter's name without wrapper modules (activation checkpointing, torch.compile)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_init_tensor(name: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of parameter ``name``, on CPU."""
    if "norm" in name:
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    std = cfg.init_std
    if name.endswith(RESIDUAL_OUTPUTS):
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    std = mup.init_std(name, len(shape), cfg, std)  # sp: unchanged; mup: by role (model/mup.py)
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_parameters(
    model: nn.Module, cfg: ModelConfig, seed: int, place: Optional[Callable[[nn.Parameter, torch.Tensor], None]] = None
) -> None:
    """Fill every parameter with its name-keyed initial value.

    ``place(param, full_value)`` copies the full value into a parameter that holds only a shard (the
    parallel layer passes one for DTensor parameters); plain parameters are copied directly.
    """
    for name, param in model.named_parameters():
        value = full_init_tensor(canonical_name(name), param.shape, cfg, seed)  # a DTensor reports its global shape
        if place is not None:
            place(param, value)
        else:
            param.copy_(value.to(device=param.device, dtype=param.dtype))

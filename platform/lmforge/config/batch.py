"""Batch arithmetic, computed in exactly one place.

global_batch_size = micro_batch_size * grad_accum * dp_size   (all in sequences)
tokens_per_step   = global_batch_size * seq_len
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmforge.config.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    grad_accum: int
    dp_size: int
    global_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len


def batch_plan(
    micro_batch_size: int,
    global_batch_size: int,
    dp_size: int,
    seq_len: int,
    grad_accum: Optional[int] = None,
) -> BatchPlan:
    """Derive (or check) gradient accumulation so that global = micro * accum * dp holds exactly."""
    if micro_batch_size < 1:
        raise ConfigError("train.micro_batch_size", f"must be >= 1, got {micro_batch_size}", "set a positive value")
    if global_batch_size < 1:
        raise ConfigError("train.global_batch_size", f"must be >= 1, got {global_batch_size}", "set a positive value")
    per_step = micro_batch_size * dp_size
    if grad_accum is None:
        if global_batch_size % per_step:
            lo = max(per_step, (global_batch_size // per_step) * per_step)
            raise ConfigError(
                "train.global_batch_size",
                f"{global_batch_size} is not divisible by micro_batch_size ({micro_batch_size}) x data-parallel "
                f"size ({dp_size}) = {per_step}",
                f"use a multiple of {per_step}, e.g. train.global_batch_size={lo} or {lo + per_step}",
            )
        grad_accum = global_batch_size // per_step
    elif micro_batch_size * grad_accum * dp_size != global_batch_size:
        raise ConfigError(
            "train.grad_accum",
            f"global_batch_size ({global_batch_size}) != micro_batch_size ({micro_batch_size}) x grad_accum "
            f"({grad_accum}) x data-parallel size ({dp_size}) = {micro_batch_size * grad_accum * dp_size}",
            "drop train.grad_accum to derive it, or make the product equal train.global_batch_size",
        )
    if grad_accum < 1:
        raise ConfigError("train.grad_accum", f"must be >= 1, got {grad_accum}", "set a positive value")
    return BatchPlan(micro_batch_size, grad_accum, dp_size, global_batch_size, seq_len)

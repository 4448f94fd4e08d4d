"""``train.precision`` on a device: the resolved mode, the parameter dtype and the autocast context.

``auto`` is ``bf16-mixed`` on CUDA (fp32 parameters, bf16 autocast) and ``fp32`` elsewhere; ``bf16`` keeps the
parameters themselves in bf16 (native engine; DeepSpeed casts through its own bf16 config). ``fp8`` autocasts like
``bf16-mixed``; its linears compute in float8 (parallel/float8.py converts them).
"""

from __future__ import annotations

import contextlib

import torch


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    return precision


def autocast_context(precision: str, device: torch.device):
    if precision in ("bf16-mixed", "fp8"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()

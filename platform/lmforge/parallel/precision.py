"""``train.precision`` on a device: the resolved mode, the parameter dtype, the autocast context and the dtype of
the residual stream.

``auto`` is ``bf16-mixed`` on CUDA and ``fp32`` elsewhere. ``bf16-mixed`` keeps fp32 parameters (the master
weights) and fp32 optimizer state, runs the matmuls in bf16 under autocast and keeps the residual stream (the
embedding output, every block's input and output, the norms' inputs) in bf16; ``train.fp32_residual`` keeps that
stream in fp32. Norm statistics are computed in fp32 inside the norm kernels and the loss in fp32
(model/loss.py) either way. ``bf16`` keeps the parameters themselves in bf16 (native engine; DeepSpeed casts
through its own bf16 config). ``fp8`` autocasts like ``bf16-mixed``; its linears compute in float8
(parallel/float8.py converts them).

The residual dtype is applied from outside the model: ``cast_residual_stream`` casts the token embedding's output
and every block's output with forward hooks, so the model code stays single-device and dtype-agnostic.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import nn


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    return precision


def autocast_context(precision: str, device: torch.device):
    if precision in ("bf16-mixed", "fp8"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def residual_dtype(precision: str, fp32_residual: bool) -> Optional[torch.dtype]:
    """The dtype the residual stream is cast to under the resolved ``precision``: bf16 under ``bf16-mixed`` and
    ``fp8`` (which autocasts like it; fp32 with ``train.fp32_residual``); None otherwise, where the parameters'
    dtype decides it (fp32, or bf16 for ``bf16``)."""
    if precision not in ("bf16-mixed", "fp8"):
        return None
    return torch.float32 if fp32_residual else torch.bfloat16


def _cast_output(dtype: torch.dtype, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.to(dtype)  # the same tensor when it already has the dtype (no copy, no autograd node)


def cast_residual_stream(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the residual stream of ``model`` (a GPT or a pipeline rank's part) to ``dtype`` where it starts and at
    every block boundary: the token embedding's output (first part only) and each block's output, so every block
    input and the final norm's input have ``dtype``. A later pipeline part receives the dtype its predecessor
    sent."""
    hook = functools.partial(_cast_output, dtype)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(hook)
    for block in model.layers.values():
        block.register_forward_hook(hook)

"""``build_engine(cfg, device, build_optimizer)``: the engine chosen by ``parallelism.engine``.

``native`` is torch's own stack (FSDP2/DDP/TP/PP, ``parallel/engine.py``); ``deepspeed`` is ZeRO-1/2/3 and
ZeRO-Offload (``parallel/deepspeed_engine.py``, imported only when chosen). Both expose the same contract.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lmforge.config.schema import RootConfig


def build_engine(cfg: RootConfig, device: torch.device, build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]):
    if cfg.parallelism.engine == "deepspeed":
        from lmforge.parallel.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(cfg, device, build_optimizer)
    from lmforge.parallel.engine import NativeEngine

    return NativeEngine(cfg, device, build_optimizer)

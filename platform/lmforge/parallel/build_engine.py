"""``build_engine(cfg, device)``: the engine chosen by ``parallelism.engine``.

``native`` is torch's own stack (FSDP2/DDP/TP/PP, ``parallel/native_engine.py``); ``deepspeed`` is ZeRO-1/2/3
and ZeRO-Offload (``parallel/deepspeed_engine.py``, imported only when chosen). Both build their model with
``parallel/parallelize.py`` and their optimizer from ``cfg.optim`` (``lmforge.optim``), and expose the same
contract.
"""

from __future__ import annotations

import torch

from lmforge.config.validated import Validated
from lmforge.parallel.deepspeed_engine import DeepSpeedEngine
from lmforge.parallel.native_engine import NativeEngine


def build_engine(cfg: Validated, device: torch.device):
    """``cfg``: what ``config.validate.validate()`` returns (the typed config and its batch plan)."""
    if cfg.parallelism.engine == "deepspeed":
        return DeepSpeedEngine(cfg, device)

    return NativeEngine(cfg, device)

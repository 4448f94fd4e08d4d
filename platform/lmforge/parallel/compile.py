"""torch.compile per transformer block (many identical blocks share one compiled graph, compile once)."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.moe import keep_experts_eager


def apply_compile(model: nn.Module) -> None:
    keep_experts_eager()  # the MoE expert compute and dispatch stay eager (model/moe.py)
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=False)

"""torch.compile per transformer block (many identical blocks share one compiled graph, compile once)."""
from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=False)

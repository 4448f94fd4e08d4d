"""Schema of the ``checkpoint`` config group (``conf/checkpoint/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal


@dataclass
class CheckpointConfig:
    name: str = "default"
    enabled: bool = True
    every_steps: int = 100  # 0: only the final checkpoint
    keep_last: int = 2
    keep_every: int = 0  # also keep every N-th step forever (0: none)
    async_mode: Annotated[str, Literal["none", "thread", "process"]] = "none"
    save_final: bool = True

"""Schema of the ``checkpoint`` config group (``conf/checkpoint/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal

from lmforge.config.ranges import NonNegativeInt, PositiveInt


@dataclass
class CheckpointConfig:
    name: str = "default"
    """The preset's name (a conf/checkpoint file name)."""
    enabled: bool = True
    """Write checkpoints at all."""
    every_steps: NonNegativeInt = 500
    """Steps between checkpoints; 0 = only the final checkpoint."""
    keep_last: PositiveInt = 2
    """Newest checkpoints kept; older ones are deleted (pinned ones stay)."""
    keep_every: NonNegativeInt = 0
    """Also keep every N-th step forever; 0 = none."""
    at_steps: List[int] = field(default_factory=list)
    """Also save after each of these steps and keep those checkpoints (the starts of WSD cooldown branches)."""
    async_mode: Annotated[str, Literal["none", "thread", "process"]] = "none"
    """Write checkpoints in the background: none (the step waits), a thread, or a process."""
    save_final: bool = True
    """Write a checkpoint after the last step."""

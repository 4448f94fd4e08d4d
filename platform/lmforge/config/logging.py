"""Schema of the ``logging`` config group (``conf/logging/*.yaml``) and of ``metrics``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal, Optional


@dataclass
class WandbConfig:
    mode: Annotated[str, Literal["online", "offline", "disabled"]] = "disabled"
    project: str = "lmforge"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    name: str = "default"
    # auto: rich on a TTY, plain lines otherwise.
    console: Annotated[str, Literal["auto", "rich", "plain", "none"]] = "auto"
    every_steps: int = 10
    jsonl: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class MetricsConfig:
    # Profile one step every N steps to measure communication/compute overlap (0 disables).
    profile_every: int = 0
    # Gather per-rank step times every N steps for straggler detection (0 disables).
    straggler_every: int = 50
    straggler_threshold: float = 1.5

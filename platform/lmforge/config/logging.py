"""Schema of the ``logging`` config group (``conf/logging/*.yaml``) and of ``metrics``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Annotated, List, Literal, Optional

from lmforge.config.errors import ConfigError
from lmforge.config.ranges import NonNegativeInt, PositiveInt, Range


@dataclass
class WandbConfig:
    mode: Annotated[str, Literal["auto", "online", "offline", "disabled"]] = "auto"
    """Weights & Biases: online, offline (a local run directory to sync later), disabled, or auto (W&B's own
    WANDB_MODE when set; else online when an API key is found, offline otherwise, announced in one line)."""
    project: str = "lmforge"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team or user); null = the account's default."""
    group: Optional[str] = None
    """W&B group; null = the sweep name, if any."""
    name: Optional[str] = None
    """W&B run name; null = the name W&B generates."""
    tags: List[str] = field(default_factory=list)
    """W&B tags."""


@dataclass
class LoggingConfig:
    name: str = "default"
    """The preset's name (a conf/logging file name)."""
    console: Annotated[str, Literal["auto", "rich", "plain", "none"]] = "auto"
    """Console output: rich, plain lines, none, or auto (rich on a TTY, plain lines otherwise)."""
    every_steps: PositiveInt = 10
    """Steps between metric lines (the only steps that read device values on the host)."""
    jsonl: bool = True
    """Write <run>/metrics.jsonl."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases sink (``logging.wandb.*``)."""
    tensorboard: bool = False
    """Also write the W&B series as TensorBoard event files in <run>/tensorboard (needs the tensorboard package:
    pip install 'lmforge[tensorboard]')."""


@dataclass
class MetricsConfig:
    profile_every: Annotated[Optional[int], Range(0, fix="e.g. 500, or 0 (off), or null (auto)")] = None
    """Profile one step every N steps to measure communication/compute overlap (comm/profiling.py); 0 = off;
    null = auto: every 500 steps on runs of more than one process, off in one process (no collectives)."""
    straggler_every: NonNegativeInt = 50
    """Gather per-rank step times every N steps for straggler detection; 0 = off."""
    straggler_threshold: float = 1.5
    """A rank whose mean compute time exceeds this many times the median over ranks is a straggler."""


def check_sink_packages(cfg: LoggingConfig) -> None:
    """A sink asked for whose package is missing is refused before anything starts (W&B's mode ``auto`` is not:
    it logs nothing and says so, metrics/wandb_sink.py)."""
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "logging.tensorboard",
            "is true but the tensorboard package is not installed",
            "pip install 'lmforge[tensorboard]' (or pip install tensorboard), or set logging.tensorboard=false",
        )

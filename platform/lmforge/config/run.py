"""Schema of ``run``: where a run lives (see lmforge.runtime.rundir for the resolution rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class RunConfig:
    # Explicit run name; wins over every other source of a run id.
    name: Optional[str] = None
    # Parent directory of all run directories.
    root: str = "runs"
    # Set by sweeps: the sweep point id (used when name is unset) and the sweep name (W&B group).
    sweep_point: Optional[str] = None
    sweep_name: Optional[str] = None

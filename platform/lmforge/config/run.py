"""Schema of ``run``: where a run lives (see lmforge.runtime.rundir for the resolution rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class RunConfig:
    name: Optional[str] = None
    """Explicit run name (a path inside run.root); wins over every other source of a run id."""
    root: str = "runs"
    """Parent directory of all run directories."""
    sweep_point: Optional[str] = None
    """Set by sweeps: the sweep point id, the run's name when run.name is unset."""
    sweep_name: Optional[str] = None
    """Set by sweeps: the sweep's name (the W&B group)."""
    sweep_params: Optional[float] = None
    """Set by sweeps: the point's parameter count N (the N of C = 6ND), in the W&B run config as sweep.N."""
    sweep_tokens: Optional[float] = None
    """Set by sweeps: the point's training tokens D, in the W&B run config as sweep.D."""
    sweep_flops: Optional[float] = None
    """Set by sweeps: the point's planned training FLOPs C, in the W&B run config as sweep.C."""

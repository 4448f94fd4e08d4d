"""Non-tensor training state that travels in the JSON sidecar: the LR schedule position.

The LR schedule is a pure function of (step, optim config, max_steps) (see ``lmforge.optim.schedule``), so its
state is the step plus the inputs of that function; on resume a change of those inputs is reported, since it
bends the LR curve from the saved step on. There is no fp16 path (``train.precision``: fp32, bf16-mixed, bf16),
so no gradient scaler is saved; a ``grad_scaler`` key in an older sidecar (always null) is ignored.
"""

from __future__ import annotations

from typing import List, Optional

from lmforge.config.optim import OptimConfig

_SCHEDULE_KEYS = ("schedule", "lr", "warmup_steps", "min_lr_ratio", "decay_fraction", "decay_steps", "decay_shape")


def scheduler_state(cfg: OptimConfig, max_steps: int, step: int, next_lr: float) -> dict:
    return {"step": step, "max_steps": max_steps, "next_lr": next_lr, **{k: getattr(cfg, k) for k in _SCHEDULE_KEYS}}


def scheduler_changes(saved: Optional[dict], cfg: OptimConfig, max_steps: int) -> List[str]:
    """Human-readable differences between the saved schedule inputs and the current ones."""
    if not saved:
        return []
    now = {"max_steps": max_steps, **{k: getattr(cfg, k) for k in _SCHEDULE_KEYS}}
    return [f"{k}: checkpoint {saved[k]!r} -> now {v!r}" for k, v in now.items() if k in saved and saved[k] != v]

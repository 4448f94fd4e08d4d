"""Loss guard: skip the optimizer update on a non-finite or spiking loss; stop after too many in a row.

``NativeEngine.train_step(..., guard=LossGuard(...))`` calls the guard with the step's global loss and
grad norm (the same values on every rank, so every rank takes the same decision). A skipped step keeps
the weights and optimizer state unchanged; its data is consumed (the batch is not retried).

After ``max_consecutive`` skipped steps in a row ``diverged`` is true: the trainer stops with a reference
to the newest checkpoint written *before* the first skipped step, which it pins against retention.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Deque, Optional

import torch


class LossGuard:
    def __init__(self, spike_factor: float = 0.0, window: int = 20, max_consecutive: int = 5):
        self.spike_factor = spike_factor
        self.max_consecutive = max_consecutive
        self.recent: Deque[float] = deque(maxlen=max(1, window))
        self.skipped_total = 0
        self.consecutive = 0
        self.first_bad_step: Optional[int] = None
        self.last_cause = ""
        self.step = 0  # set by the trainer before each step

    def verdict(self, loss: float, grad_norm: float) -> str:
        """'' if the update may proceed, else the reason to skip it."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not math.isfinite(grad_norm):
            return f"non-finite grad norm ({grad_norm})"
        if self.spike_factor > 0 and len(self.recent) >= min(5, self.recent.maxlen or 5):
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                return f"loss spike {loss:.4f} > {self.spike_factor} x running mean {mean:.4f}"
        return ""

    def __call__(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        lv, gv = float(loss), float(grad_norm)
        cause = self.verdict(lv, gv)
        if cause:
            self.skipped_total += 1
            self.consecutive += 1
            if self.first_bad_step is None:
                self.first_bad_step = self.step
            self.last_cause = cause
            return False
        self.recent.append(lv)
        self.consecutive = 0
        self.first_bad_step = None
        self.last_cause = ""
        return True

    @property
    def diverged(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive

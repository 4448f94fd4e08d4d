"""Loss guard: skip the optimizer update on a non-finite or spiking loss; stop after too many in a row.

The decision is taken **on the device**, so the guard adds no host sync to the step:

1. ``skip = guard.skip_tensor(loss, grad_norm)`` — a boolean device tensor from the step's global loss and
   grad norm (the same values on every rank, so every rank takes the same decision). The running mean of
   the last ``window`` accepted losses lives on the device too.
2. The engine applies it without reading it: a fused AdamW takes it as ``found_inf`` and leaves weights,
   moments and step count untouched (the mechanism ``GradScaler`` uses); other optimizers read it (one sync).
3. The host bookkeeping (skip counts, events, the divergence stop) follows from a :class:`HostCopy` of the
   verdict, read when the device got there: at once on the CPU, at most a step later on a GPU.
   :meth:`resolve` returns the verdicts that are readable (``force``: all of them).

A skipped step keeps the weights and optimizer state unchanged; its data is consumed (the batch is not
retried). After ``max_consecutive`` skipped steps in a row ``diverged`` is true: the trainer stops with a
reference to the newest checkpoint written *before* the first skipped step, which it pins against retention.

``guard(loss, grad_norm) -> bool`` is the same decision read at once (the DeepSpeed engine, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from lmforge.runtime.host_copy import HostCopy

MIN_SPIKE_HISTORY = 5  # accepted losses needed before the spike rule applies (fewer if the window is smaller)


@dataclass
class Verdict:
    step: int
    skipped: bool
    cause: str  # '' when the update went through


class LossGuard:
    def __init__(self, spike_factor: float = 0.0, window: int = 20, max_consecutive: int = 5):
        self.spike_factor = spike_factor
        self.window = max(1, window)
        self.max_consecutive = max_consecutive
        self.skipped_total = 0
        self.consecutive = 0
        self.first_bad_step: Optional[int] = None
        self.last_cause = ""
        self.step = 0  # set by the trainer before each step
        self._recent: Optional[torch.Tensor] = None  # [window] accepted losses (float64, device), ring buffer
        self._count: Optional[torch.Tensor] = None  # how many of them are filled (<= window)
        self._slot: Optional[torch.Tensor] = None  # where the next accepted loss goes
        self._slots: Optional[torch.Tensor] = None  # arange(window): the ring's positions
        self._pending: List[Tuple[int, HostCopy]] = []

    # ---- on the device -------------------------------------------------------------------------------
    @torch.no_grad()
    def skip_tensor(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The verdict for this step as a boolean device tensor (True: skip the update). Never syncs."""
        device = loss.device
        if self._recent is None:
            self._recent = torch.zeros(self.window, dtype=torch.float64, device=device)
            self._count = torch.zeros((), dtype=torch.int64, device=device)
            self._slot = torch.zeros((), dtype=torch.int64, device=device)
            self._slots = torch.arange(self.window, device=device)
        lv = loss.detach().to(torch.float64)
        gv = grad_norm.detach().to(device=device, dtype=torch.float64)
        mean = self._recent.sum() / self._count.clamp(min=1)
        skip = ~(torch.isfinite(lv) & torch.isfinite(gv))
        if self.spike_factor > 0:
            enough = self._count >= min(MIN_SPIKE_HISTORY, self.window)
            skip = skip | (enough & (lv > self.spike_factor * mean))
        keep = ~skip
        here = self._slots == self._slot
        self._recent = torch.where(here & keep, lv, self._recent)
        self._slot = torch.where(keep, (self._slot + 1) % self.window, self._slot)
        self._count = torch.where(keep, (self._count + 1).clamp(max=self.window), self._count)
        self._pending.append((self.step, HostCopy(torch.stack([skip.to(torch.float64), lv, gv, mean]))))
        return skip

    # ---- on the host ---------------------------------------------------------------------------------
    def cause(self, loss: float, grad_norm: float, mean: float) -> str:
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not math.isfinite(grad_norm):
            return f"non-finite grad norm ({grad_norm})"
        return f"loss spike {loss:.4f} > {self.spike_factor} x running mean {mean:.4f}"

    def resolve(self, force: bool = False) -> List[Verdict]:
        """Book the verdicts readable now, oldest first; all of them with ``force``. Only the newest may stay
        pending: an older one is read even if that waits (the device is then a step behind the host at most)."""
        out = []
        while self._pending and (force or len(self._pending) > 1 or self._pending[0][1].ready()):
            step, copy = self._pending.pop(0)
            skipped, loss, grad_norm, mean = copy.values()
            out.append(self._book(step, bool(skipped), loss, grad_norm, mean))
        return out

    def _book(self, step: int, skipped: bool, loss: float, grad_norm: float, mean: float) -> Verdict:
        if not skipped:
            self.consecutive = 0
            self.first_bad_step = None
            self.last_cause = ""
            return Verdict(step, False, "")
        self.skipped_total += 1
        self.consecutive += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        self.last_cause = self.cause(loss, grad_norm, mean)
        return Verdict(step, True, self.last_cause)

    def __call__(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Decide and book at once: True if the update may proceed."""
        self.skip_tensor(loss, grad_norm)
        return not self.resolve(force=True)[-1].skipped

    @property
    def diverged(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive

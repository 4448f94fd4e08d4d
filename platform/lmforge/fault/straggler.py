"""Straggler detection: every ``every`` steps, gather each rank's mean step time and name the slow ones.

A rank is a straggler when its mean step time over the window exceeds ``threshold`` x the median over
ranks. The gather is one small all_gather every ``every`` steps (a collective every rank joins, so it is
called on every rank). Rank 0 records one ``straggler`` event per slow rank (metrics JSONL, W&B) and
returns a summary for the step's metrics record.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

import torch
import torch.distributed as dist


def find_stragglers(times: List[float], threshold: float) -> List[int]:
    """Ranks whose time exceeds ``threshold`` x the median of all ranks."""
    if not times:
        return []
    median = statistics.median(times)
    if median <= 0:
        return []
    return [r for r, t in enumerate(times) if t > threshold * median]


class StragglerDetector:
    def __init__(self, every: int, threshold: float, device: torch.device):
        self.every = every
        self.threshold = threshold
        self.device = device
        self._sum = 0.0
        self._n = 0

    def observe(self, step: int, step_time_s: float) -> Optional[Dict[str, object]]:
        """Record one step; on gather steps return {'times': [...], 'stragglers': [...], 'median': m}."""
        if self.every <= 0:
            return None
        self._sum += step_time_s
        self._n += 1
        if step % self.every != 0:
            return None
        mean = self._sum / max(1, self._n)
        self._sum, self._n = 0.0, 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            mine = torch.tensor([mean], dtype=torch.float64, device=self.device)
            out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(out, mine)
            times = [float(t.item()) for t in out]
        else:
            times = [mean]
        return {"times": times, "stragglers": find_stragglers(times, self.threshold),
                "median": statistics.median(times)}

"""Rank-side checks of expert parallelism that run inside the parity harness's launches (``{"call": ...}`` cases of
parallel_worker.run_cases): resuming an ep2 checkpoint at other expert layouts."""

from __future__ import annotations

from typing import Dict, List

import torch.distributed as dist
from distributed.parallel_worker import resume_case


def resume_across_ep(layouts: Dict[str, List[str]], samples: List[List[int]], steps: int, checkpoint: str) -> dict:
    """Load the checkpoint (saved by an earlier case of the same launch) under each layout and run one more step."""
    out = {}
    for name, overrides in layouts.items():
        out[name] = resume_case(overrides, samples, steps, checkpoint)
        dist.barrier()
    return out

"""Rank, world size and barrier of the default process group: the one place the rest of lmforge asks them.

Every function works before (or without) a process group, as a single process: rank 0 of a world of 1.
Groups other than the default one (a mesh dimension's) are passed explicitly where they are used.
"""

from __future__ import annotations

import torch.distributed as dist


def is_distributed() -> bool:
    """A default process group exists (this process is one rank of a job)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """All ranks of the default group meet here; a no-op for a single process."""
    if is_distributed() and dist.get_world_size() > 1:
        dist.barrier()

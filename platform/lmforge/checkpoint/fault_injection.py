"""Test seams into a checkpoint save: freeze it half-way, or run a hook at each stage of its commit.

Set ``LMFORGE_CKPT_PAUSE_SAVE="step=<S>,after_shards=<k>"`` in the environment of every rank. When the
save of step ``S`` writes its DCP shard files, ranks ``0..k-1`` write theirs normally and the other ranks
write ``PAUSED.rank<r>`` into the temporary directory and sleep forever instead of writing their shard. The
save therefore never completes: the temporary ``.tmp-step-<S>`` directory holds exactly ``k`` shard files
and no ``COMPLETE`` marker, which is what a crash mid-save leaves behind. Unset, this module does nothing.

``install_commit_hook(fn)`` (Python, not configuration) runs ``fn(stage, step, final_dir)`` after each stage
of the commit protocol (``checkpoint/commit.py``); tests/distributed/test_commit_kill.py kills the writer there.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

ENV = "LMFORGE_CKPT_PAUSE_SAVE"


def pause_spec(step: int) -> Optional[int]:
    """``after_shards`` if the environment asks to pause the save of ``step``, else None."""
    raw = os.environ.get(ENV, "")
    if not raw:
        return None
    fields = dict(part.split("=", 1) for part in raw.split(",") if "=" in part)
    try:
        if int(fields["step"]) != step:
            return None
        return int(fields.get("after_shards", "1"))
    except (KeyError, ValueError):
        raise ValueError(f"{ENV}={raw!r}: expected 'step=<int>,after_shards=<int>'") from None


class PausingWriter(FileSystemWriter):
    """A FileSystemWriter whose ranks >= ``after_shards`` stop before writing their shard."""

    def __init__(self, path: Path, after_shards: int):
        super().__init__(str(path))
        self.after_shards = after_shards
        self.dir = Path(path)

    def write_data(self, plan, planner):
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank >= self.after_shards:
            (self.dir / f"PAUSED.rank{rank}").write_text(str(os.getpid()))
            while True:  # until the test kills the job
                time.sleep(3600)
        return super().write_data(plan, planner)


# ---- commit-stage hook (installed by a test's worker process, never by configuration) ----------------
CommitHook = Callable[[str, int, Path], None]
_commit_hook: Optional[CommitHook] = None


def install_commit_hook(hook: Optional[CommitHook]) -> None:
    """Call ``hook(stage, step, final_dir)`` after each stage of every checkpoint commit in this process
    (stages: ``checkpoint.commit.STAGES``). A test's worker installs it before calling ``lmforge.train.main``,
    e.g. to SIGKILL the writer at one stage; None removes it."""
    global _commit_hook
    _commit_hook = hook


def commit_stage(stage: str, step: int, final: Path) -> None:
    """Called by the commit protocol after each stage; does nothing unless a hook is installed."""
    if _commit_hook is not None:
        _commit_hook(stage, step, final)

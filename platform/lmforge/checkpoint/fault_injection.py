"""Test seams into a checkpoint save, installed in Python by a test's own process (never by configuration or
the environment): freeze a save half-way, or run a hook at each stage of its commit.

``install_save_pause(step, after_shards)``: when the save of ``step`` writes its DCP shard files, ranks
``0..after_shards-1`` write theirs normally and the other ranks write ``PAUSED.rank<r>`` into the temporary
directory and sleep forever instead of writing their shard. The save therefore never completes: the temporary
``.tmp-step-<S>`` directory holds exactly ``after_shards`` shard files and no ``COMPLETE`` marker, which is what a
crash mid-save leaves behind. Each rank's process installs it (tests/distributed/pausing_train.py: an entry
script that installs it, then calls ``lmforge.train.main``). Not installed, ``storage_writer`` is DCP's own.

``install_commit_hook(fn)`` runs ``fn(stage, step, final_dir)`` after each stage of the commit protocol
(``checkpoint/commit.py``, stages ``commit.STAGES``); tests/distributed/test_commit_kill.py kills the writer
there, tests/unit/test_checkpoint_manager.py raises at ``shards`` (a crash between the shards and the commit).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

from torch.distributed.checkpoint import FileSystemWriter

from lmforge.runtime.dist import rank

_pause: Optional[Tuple[int, int]] = None  # (step, after_shards)


def install_save_pause(step: Optional[int], after_shards: int = 1) -> None:
    """Freeze the save of ``step`` in this process after ``after_shards`` ranks wrote their shard; None removes it."""
    global _pause
    _pause = None if step is None else (int(step), int(after_shards))


def storage_writer(directory: Path, step: int) -> FileSystemWriter:
    """The DCP writer for the save of ``step`` into ``directory``: DCP's own unless a pause is installed for it."""
    if _pause is not None and _pause[0] == step:
        return PausingWriter(directory, _pause[1])
    return FileSystemWriter(str(directory))


class PausingWriter(FileSystemWriter):
    """A FileSystemWriter whose ranks >= ``after_shards`` stop before writing their shard."""

    def __init__(self, path: Path, after_shards: int):
        super().__init__(str(path))
        self.after_shards = after_shards
        self.dir = Path(path)

    def write_data(self, plan, planner):
        r = rank()
        if r >= self.after_shards:
            (self.dir / f"PAUSED.rank{r}").write_text(str(os.getpid()))
            while True:  # until the test kills the job
                time.sleep(3600)
        return super().write_data(plan, planner)


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

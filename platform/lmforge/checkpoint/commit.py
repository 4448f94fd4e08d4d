"""The commit protocol: turn a fully written ``.tmp-step-N/`` into the complete checkpoint ``step-N/``.

Rank 0 runs it once every rank has finished writing its tensor files. Each stage makes the previous one
durable before the next one can be observed, so a crash (SIGKILL, power loss) at any point leaves the newest
*complete* checkpoint loadable (docs/checkpointing.md walks through every stage):

1. ``shards``   every file in the temporary directory: mode 0o640, fsynced (DCP's writer already fsyncs its
                own files; DeepSpeed's ``torch.save`` files are not, so this is where they become durable).
2. ``sidecar``  ``state.json`` written to a temporary name, fsynced, renamed into place.
3. ``complete`` ``COMPLETE`` written and fsynced, then the temporary directory fsynced (its entries are on
                disk). The checkpoint is whole but still invisible: its name starts with ``.tmp``.
4. ``aside``    (re-save of an existing step only) the old ``step-N/`` renamed to ``.old-step-N/`` and the
                parent fsynced. ``step-N`` is absent for a moment; the aside copy is complete and resolved
                (``layout.complete_checkpoints``), so the old checkpoint stays loadable.
5. ``renamed``  ``.tmp-step-N/`` renamed to ``step-N/`` (the atomic commit point) and the parent fsynced.
6. the aside copy (if any) deleted and the parent fsynced again.

``on_stage(name)`` is called after each numbered stage; tests inject a hook there to kill the writer
(``checkpoint/fault_injection.py``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from lmforge.checkpoint.layout import (
    COMPLETE,
    SIDECAR,
    aside_dir,
    is_aside,
    is_complete,
    stale_asides,
    step_dir,
    step_of,
)
from lmforge.runtime.file_modes import FILE_MODE as RUN_FILE_MODE
from lmforge.runtime.rundir import RUN_DIR_MODE

FILE_MODE = RUN_FILE_MODE  # 0o640 (runtime/file_modes.py: every file of a run)
DIR_MODE = RUN_DIR_MODE  # 0o750, as the run directory around it
STAGES = ("shards", "sidecar", "complete", "aside", "renamed")
_NO_DIR_FSYNC: list = []  # the first directory that refused an fsync (announced once)


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (creations, renames) durable. A filesystem that cannot fsync a directory
    (EINVAL/ENOTSUP, e.g. some FUSE mounts) is announced once; the rename order still holds there."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
        if not _NO_DIR_FSYNC:
            _NO_DIR_FSYNC.append(str(path))
            print(
                f"lmforge: warning: directory fsync is not supported under {path} ({e.strerror}); a checkpoint "
                f"commit is then only as durable as the filesystem's own rename ordering",
                flush=True,
            )
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path) -> None:
    """Create a checkpoint directory with ``DIR_MODE`` (whatever the umask)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def seal_files(directory: Path) -> None:
    """Every file under ``directory``: ``FILE_MODE``, then fsynced; every sub-directory ``DIR_MODE`` and fsynced."""
    for sub, dirs, files in os.walk(directory):
        for name in files:
            path = Path(sub) / name
            os.chmod(path, FILE_MODE)
            _fsync_file(path)
        for name in dirs:
            os.chmod(Path(sub) / name, DIR_MODE)
        if Path(sub) != directory:
            fsync_dir(Path(sub))


def write_durable(path: Path, text: str) -> None:
    """``text`` into ``path`` so that ``path`` is either absent or whole: temp file, fsync, rename."""
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)


def commit(tmp: Path, final: Path, step: int, sidecar: dict, on_stage: Optional[Callable[[str], None]] = None) -> None:
    """Run the stages above; ``tmp`` holds every tensor file, ``final`` may hold an older copy of ``step``."""
    stage = on_stage or (lambda name: None)
    root = final.parent
    seal_files(tmp)
    stage("shards")
    write_durable(tmp / SIDECAR, json.dumps(sidecar, indent=1, sort_keys=True))
    stage("sidecar")
    write_durable(tmp / COMPLETE, str(step))
    os.chmod(tmp, DIR_MODE)
    fsync_dir(tmp)
    stage("complete")
    aside = aside_dir(root, step)
    if final.exists():  # a re-save of the same step (e.g. preemption right after a periodic save)
        if aside.exists():  # left by an earlier crash after its rename-in: final is the newer copy
            shutil.rmtree(aside)
        os.replace(final, aside)
        fsync_dir(root)
        stage("aside")
    os.replace(tmp, final)
    fsync_dir(root)
    stage("renamed")
    if aside.exists():
        shutil.rmtree(aside)
        fsync_dir(root)


def restore_asides(root: Path) -> None:
    """Undo what a crash between the two renames of a re-save left: ``.old-step-N`` back to ``step-N`` when no
    ``step-N`` exists (the old copy is the checkpoint of that step again), deleted when ``step-N`` is complete."""
    if not root.is_dir():
        return
    for aside in [p for p in root.iterdir() if is_aside(p) and is_complete(p)]:
        final = step_dir(root, step_of(aside))
        if not final.exists():
            os.replace(aside, final)
            fsync_dir(root)
    for stale in stale_asides(root):
        shutil.rmtree(stale, ignore_errors=True)

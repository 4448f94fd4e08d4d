"""The modes of everything lmforge writes into a run directory or an export: files 0o640, directories 0o750.

Set explicitly, whatever the umask: a run directory holds the resolved config, provenance (host names, the
environment) and the model, which the owner's group may read (a project group sharing results) and nobody else
may; and a run's files are written by processes on several nodes (a login node, batch jobs, srun steps) whose umasks
differ, so only an explicit mode gives every file of a run the same answer. Files other programs write into a run
directory or export (Hydra's ``.hydra/`` and job log, safetensors' shards, W&B's folder) are set to the same modes
afterwards with :func:`set_tree`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO, Union

FILE_MODE = 0o640  # owner read/write, group read, others nothing
DIR_MODE = 0o750  # owner all, group read/enter, others nothing


def make_dir(path: Union[str, os.PathLike]) -> Path:
    """``path`` (and missing parents) as a directory; ``path`` itself ``DIR_MODE``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def _open_fd(path: Path, flags: int) -> int:
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have taken bits from FILE_MODE, or the file was there already
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_write(path: Union[str, os.PathLike]) -> TextIO:
    """``path`` opened for writing text (created, or truncated), mode ``FILE_MODE``."""
    return os.fdopen(_open_fd(Path(path), os.O_WRONLY | os.O_TRUNC), "w", encoding="utf-8")


def write_text(path: Union[str, os.PathLike], text: str) -> Path:
    """``text`` into ``path`` (created or truncated), mode ``FILE_MODE``. For a whole-or-nothing file write a
    temporary name with this, then ``os.replace`` it: the mode goes with the rename."""
    with open_write(path) as fh:
        fh.write(text)
    return Path(path)


def open_exclusive(path: Union[str, os.PathLike]) -> TextIO:
    """``path`` created for writing text, mode ``FILE_MODE``; FileExistsError when it exists (a number taken)."""
    return os.fdopen(_open_fd(Path(path), os.O_WRONLY | os.O_EXCL), "w", encoding="utf-8")


def open_append(path: Union[str, os.PathLike], buffering: int = -1) -> TextIO:
    """``path`` opened for appending text (created when missing), mode ``FILE_MODE``."""
    return os.fdopen(_open_fd(Path(path), os.O_WRONLY | os.O_APPEND), "a", buffering=buffering, encoding="utf-8")


def set_tree(root: Union[str, os.PathLike]) -> None:
    """``root`` and every directory under it ``DIR_MODE``, every file ``FILE_MODE`` (links are left alone). A
    file that disappears meanwhile (a temporary name renamed) is skipped."""
    root = Path(root)
    if not root.is_dir() or root.is_symlink():
        return
    os.chmod(root, DIR_MODE)
    for sub, dirs, files in os.walk(root):
        for name, mode in [(d, DIR_MODE) for d in dirs] + [(f, FILE_MODE) for f in files]:
            path = Path(sub) / name
            try:
                if not path.is_symlink():
                    os.chmod(path, mode)
            except FileNotFoundError:
                continue


def set_file(path: Union[str, os.PathLike]) -> None:
    """One file another program wrote (Hydra's job log): ``FILE_MODE``, when it is there."""
    try:
        if not Path(path).is_symlink():
            os.chmod(path, FILE_MODE)
    except FileNotFoundError:
        pass

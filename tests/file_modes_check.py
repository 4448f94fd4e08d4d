"""The run-directory mode policy (lmforge.runtime.file_modes) as a check: every entry under a root walked."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Iterator, List


def wrong_modes(root: Path) -> List[str]:
    """``path mode`` for each file under ``root`` not 0o640 and each directory (``root`` too) not 0o750."""
    wrong = []
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = 0o750 if path.is_dir() else 0o640
        if not path.is_symlink() and mode != want:
            wrong.append(f"{path.relative_to(root.parent)} {mode:o}")
    return wrong


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process umask set to ``mask`` inside the block (a permissive one shows the modes are set explicitly)."""
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)

"""An exclusive file lock: serialises builders of the same file across processes (and nodes, where the
filesystem supports ``flock``). Shards, the embedded tokenizer and megatron-core's index cache are built under it."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (works across processes and, on NFSv4/Lustre with flock, nodes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

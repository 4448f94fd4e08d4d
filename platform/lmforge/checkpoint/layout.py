"""Names inside ``<run>/checkpoints/`` and the rules for which checkpoint is complete.

    step-00000100/            a complete checkpoint: DCP files + state.json + COMPLETE
    .tmp-step-00000200/       a save in progress (or a crashed one): never loaded, removed on the next save

A checkpoint is complete iff its directory name has no ``.tmp`` prefix and holds ``COMPLETE``; the
rename from the temporary name happens only after every rank finished writing and the sidecar is on disk.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

STEP_RE = re.compile(r"^step-(\d{8})$")
COMPLETE = "COMPLETE"
SIDECAR = "state.json"
PINNED = "PINNED"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def is_complete(path: Path) -> bool:
    return bool(STEP_RE.match(path.name)) and (path / COMPLETE).is_file() and (path / SIDECAR).is_file()


def complete_checkpoints(root: Path) -> List[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def latest(root: Path) -> Optional[Path]:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def step_of(path: Path) -> int:
    m = STEP_RE.match(path.name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint directory (expected step-NNNNNNNN)")
    return int(m.group(1))

"""Names inside ``<run>/checkpoints/`` and the rules for which checkpoint is complete.

    step-00000100/            a complete checkpoint: DCP files + state.json + COMPLETE
    .tmp-step-00000200/       a save in progress (or a crashed one): never loaded, removed on the next save
    .old-step-00000200/       the previous copy of step 200 while a re-save of step 200 is renamed in; it is
                              a complete checkpoint, and the one resolved if a crash left no step-00000200/

A checkpoint is complete iff its directory is named ``step-N`` (or ``.old-step-N``) and holds ``COMPLETE``
and ``state.json``; the commit protocol (``checkpoint/commit.py``) writes both before the atomic rename
from the temporary name, so a directory is either absent under its final name or complete.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

STEP_RE = re.compile(r"^step-(\d{8})$")
ASIDE_RE = re.compile(r"^\.old-step-(\d{8})$")
COMPLETE = "COMPLETE"
SIDECAR = "state.json"
PINNED = "PINNED"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def aside_dir(root: Path, step: int) -> Path:
    """Where the old copy of ``step`` waits while a re-save of the same step is renamed in."""
    return root / f".old-step-{step:08d}"


def parse_step(name: str) -> Optional[int]:
    """The step a checkpoint directory name (``step-N`` or ``.old-step-N``) holds, or None: the one place a step
    number is read from a name."""
    m = STEP_RE.match(name) or ASIDE_RE.match(name)
    return int(m.group(1)) if m else None


def is_aside(path: Path) -> bool:
    return bool(ASIDE_RE.match(path.name))


def is_complete(path: Path) -> bool:
    return parse_step(path.name) is not None and (path / COMPLETE).is_file() and (path / SIDECAR).is_file()


def complete_checkpoints(root: Path) -> List[Path]:
    """Complete checkpoints by step; for each step ``step-N`` wins over an aside copy ``.old-step-N``
    (both exist only when a crash hit after the re-save was renamed in and before the old copy was deleted)."""
    if not root.is_dir():
        return []
    by_step: Dict[int, Path] = {}
    for p in root.iterdir():
        if p.is_dir() and is_complete(p):
            step = step_of(p)
            if step not in by_step or not is_aside(p):
                by_step[step] = p
    return [by_step[s] for s in sorted(by_step)]


def stale_asides(root: Path) -> List[Path]:
    """Aside copies whose step has a complete ``step-N`` again: left by a crash, safe to delete."""
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if is_aside(p) and is_complete(step_dir(root, step_of(p)))]


def latest(root: Path, at_or_before: Optional[int] = None) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (with step <= ``at_or_before`` if given), or None."""
    done = [p for p in complete_checkpoints(root) if at_or_before is None or step_of(p) <= at_or_before]
    return done[-1] if done else None


def step_of(path: Path) -> int:
    step = parse_step(path.name)
    if step is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected step-NNNNNNNN)")
    return step

"""Which complete checkpoints to keep: the newest ``keep_last``, every ``keep_every``-th step, and every pinned one.

A pure function over step numbers, so the policy is testable without touching the disk. Pinning (a ``PINNED``
file in the checkpoint directory, holding the reason) is how the loss guard or a user protects a checkpoint,
e.g. the last good one before a divergence; retention never deletes a pinned checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Optional, Set, Tuple

from lmforge.checkpoint.layout import PINNED, complete_checkpoints, latest, step_of
from lmforge.runtime.dist import rank
from lmforge.runtime.file_modes import write_text


def plan_retention(
    steps: Iterable[int], keep_last: int, keep_every: int, pinned: Iterable[int] = ()
) -> Tuple[Set[int], Set[int]]:
    """Return ``(keep, delete)`` for the given complete checkpoint steps."""
    ordered = sorted(set(steps))
    keep: Set[int] = set(ordered[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    keep |= set(pinned) & set(ordered)
    return keep, set(ordered) - keep


# ---- pins: the one place a checkpoint is protected from retention ---------------------------------------
def pin(path: Path, reason: str) -> None:
    """Protect checkpoint ``path`` from retention (rank 0 writes the ``PINNED`` file holding ``reason``)."""
    if rank() == 0:
        write_text(Path(path) / PINNED, reason)


def unpin(path: Path) -> None:
    if rank() == 0:
        (Path(path) / PINNED).unlink(missing_ok=True)


def is_pinned(path: Path) -> bool:
    return (Path(path) / PINNED).exists()


def pinned(root: Path) -> Dict[int, str]:
    """Pinned complete checkpoints under ``root``: step -> reason."""
    return {step_of(p): (p / PINNED).read_text() for p in complete_checkpoints(root) if is_pinned(p)}


def pin_last_good(
    root: Path, reason: str, at_or_before: Optional[int] = None, unless_pinned: bool = False
) -> Optional[Path]:
    """Pin the newest complete checkpoint under ``root`` (with step <= ``at_or_before`` if given): the last good
    one before a loss spike, a divergence or a replica mismatch. Returns it (on every rank), or None when there is
    none, or, with ``unless_pinned``, when it is pinned already (so the caller does not own that pin)."""
    good = latest(root, at_or_before)
    if good is None or (unless_pinned and is_pinned(good)):
        return None
    pin(good, reason)
    return good

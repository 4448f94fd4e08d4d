"""Which complete checkpoints to keep: the newest ``keep_last``, every ``keep_every``-th step, and every pinned one.

A pure function over step numbers, so the policy is testable without touching the disk. Pinning (a ``PINNED``
file in the checkpoint directory, holding the reason) is how the loss guard or a user protects a checkpoint,
e.g. the last good one before a divergence; retention never deletes a pinned checkpoint.
"""
from __future__ import annotations

from typing import Iterable, Set, Tuple


def plan_retention(steps: Iterable[int], keep_last: int, keep_every: int,
                   pinned: Iterable[int] = ()) -> Tuple[Set[int], Set[int]]:
    """Return ``(keep, delete)`` for the given complete checkpoint steps."""
    ordered = sorted(set(steps))
    keep: Set[int] = set(ordered[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    keep |= set(pinned) & set(ordered)
    return keep, set(ordered) - keep

"""Rank function for tests/distributed/test_replica_consistency.py (run by harness.run_ranks)."""

from __future__ import annotations

from typing import List


def train_exit_code(argv: List[str]) -> dict:
    """``python -m lmforge.train ARGV`` in this rank; the exit code it ends with (0 when it returns)."""
    from lmforge.train import main

    try:
        return {"code": main(argv)}
    except SystemExit as e:
        return {"code": e.code}

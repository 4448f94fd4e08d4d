"""Rank-side: several trainings through the real entry point, one after the other, in one launch of the ranks.

Each ``python -m lmforge.train ARGV`` runs in full (Hydra composition, validation, engine, loop, run directory) on
the process group the first one initialised; sharing the launch saves the ranks' start-up (interpreter, torch,
lmforge, gloo rendezvous), most of the cost of a few-step run on CPU. Each training's console output follows a
``MARK`` line, so a test can read one training's output (``section``).
"""

from __future__ import annotations

import sys
from typing import List

MARK = "=== train_entries: training "


def train_entries(argvs: List[List[str]]) -> List[int]:
    """``lmforge.train.main(argv)`` for each argv in order; the exit codes (a non-zero one stops the sequence)."""
    from lmforge.train import main

    codes = []
    for i, argv in enumerate(argvs):
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{MARK}{i}", flush=True)
        codes.append(main(argv))
        if codes[-1] != 0:
            break
    sys.stdout.flush()
    sys.stderr.flush()
    return codes


def section(output: str, i: int) -> str:
    """The console output of training ``i`` in a rank's log."""
    parts = output.split(MARK)
    assert len(parts) > i + 1, f"no output of training {i}:\n{output[-3000:]}"
    return parts[i + 1].split("\n", 1)[1] if "\n" in parts[i + 1] else ""

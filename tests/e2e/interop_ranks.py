"""Rank entry points for tests/e2e/test_interop_hf_e2e.py (started by harness.run_ranks)."""
from __future__ import annotations

import os
from typing import List


def train(argv: List[str]) -> dict:
    """``lmforge train ARGV`` on this rank, exactly as the command line would run it (Hydra included)."""
    from lmforge.train import main

    main(list(argv))
    return {"rank": int(os.environ["RANK"])}

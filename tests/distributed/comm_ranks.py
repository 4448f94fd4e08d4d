"""Rank entry points for tests/distributed/test_comm.py (started by harness.run_ranks on real gloo groups)."""
from __future__ import annotations

from pathlib import Path
from typing import List


def bench(argv: List[str]) -> dict:
    """``lmforge comm bench ARGV`` on this rank; returns the exit status."""
    import torch.distributed as dist

    from lmforge.comm.cli import bench_main

    rc = bench_main(argv)
    return {"rc": rc, "initialized_after": dist.is_initialized()}


def train(overrides: List[str], run_dir: str) -> dict:
    """One real training run through the Trainer (the comm preflight and overlap probe included)."""
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.trainer.trainer import Trainer

    trainer = Trainer(validate(compose(overrides)), Path(run_dir))
    trainer.fit()
    return {"rank": trainer.rank, "overlap": trainer.overlap.last}

"""Rank functions for tests/distributed/test_fault_watchdog.py (run by harness.run_ranks)."""
from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def withheld_collective(run_dir: str, timeout_s: float, hold_s: float) -> dict:
    """Rank 0 withholds the all_reduce that rank 1 enters; rank 1's watchdog must fire and exit 43."""
    from lmforge.fault.events import FaultEvents
    from lmforge.fault.watchdog import Watchdog

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    dist.barrier()
    run = Path(run_dir)
    events = FaultEvents(run / "metrics.jsonl", rank)
    dog = Watchdog(rank, timeout_s, run / "dumps", run / "heartbeats", poll_s=0.2, orphan_check=False,
                   on_event=events.emit).start()
    dog.beat(7)
    if rank == 0:
        dog.pause()
        time.sleep(hold_s)  # never joins the collective
        return {"rank": 0}
    t = torch.ones(4)
    dist.all_reduce(t)  # blocks: the peer withholds the call
    return {"rank": rank, "unexpected": "all_reduce returned"}

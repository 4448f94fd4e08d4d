"""Rank functions for tests/distributed/test_fault_watchdog.py (run by harness.run_ranks)."""

from __future__ import annotations

import datetime
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
    dog = Watchdog(
        rank, timeout_s, run / "dumps", run / "heartbeats", poll_s=0.2, orphan_check=False, on_event=events.emit
    ).start()
    dog.beat(7)
    if rank == 0:
        dog.pause()
        time.sleep(hold_s)  # never joins the collective
        return {"rank": 0}
    t = torch.ones(4)
    dist.all_reduce(t)  # blocks: the peer withholds the call
    return {"rank": rank, "unexpected": "all_reduce returned"}


def slow_rank(run_dir: str) -> dict:
    """Rank 1's steps take 3x as long; every rank gathers the host names once and the times every 4 steps, rank 0
    names rank 1 (and its host) a straggler, as ``FaultHooks`` does."""
    from lmforge.fault.events import FaultEvents
    from lmforge.fault.straggler import StragglerDetector, describe_straggler, gather_hostnames

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    detector = StragglerDetector(every=4, threshold=1.5, device=torch.device("cpu"))
    detector.hosts = gather_hostnames(torch.device("cpu"))
    events = FaultEvents(Path(run_dir) / "metrics.jsonl", rank)
    found = None
    for step in range(1, 9):
        out = detector.observe(step, 0.3 if rank == 1 else 0.1)
        if out is not None:
            found = out
            if rank == 0:
                for r in out["stragglers"]:
                    host = detector.host(r)
                    cause, fields = describe_straggler(out, r, host=host, threshold=1.5, every=4, mode="wall step time")
                    events.emit("straggler", step, cause, rank=r, host=host, **fields)
    return {**found, "hosts": detector.hosts}


def stop_vote(flag_steps: dict) -> dict:
    """Each rank raises its stop flag from step ``flag_steps[rank]`` on (absent: never) while real gradient-like
    all-reduces run in between; returns the step at which this rank's vote said stop."""
    from lmforge.comm.vote import LaggedVote

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    vote = LaggedVote(torch.device("cpu"), "any")
    first = flag_steps.get(str(rank))
    for step in range(1, 20):
        t = torch.full((1024,), float(rank))
        dist.all_reduce(t)  # the step's own traffic on the same group
        if vote.exchange(first is not None and step >= first):
            vote.collect()
            dist.barrier()
            return {"rank": rank, "stop_step": step}
    return {"rank": rank, "stop_step": None}

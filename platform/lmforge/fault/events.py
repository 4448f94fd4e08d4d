"""Fault events from any rank into the run's metrics JSONL (and every other sink on rank 0).

Rank 0 owns the metrics sinks (``MetricsLogger``); a fault can strike any rank, and rank 0 may be the one
that is stuck. So a non-zero rank appends its event line to ``metrics.jsonl`` itself (one short O_APPEND
write, which does not interleave with rank 0's lines). Every event is also printed to stderr, so it lands
in the launcher's log (the Slurm ``.err`` file) even when the run directory is unreachable.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from lmforge.metrics.logger import MetricsLogger
from lmforge.metrics.sinks import JsonlSink


class FaultEvents:
    def __init__(self, metrics_path: Path, rank: int, logger: Optional[MetricsLogger] = None, jsonl: bool = True):
        self.metrics_path = metrics_path
        self.rank = rank
        self.logger = logger
        self.jsonl = jsonl

    def emit(
        self, event: str, step: int, cause: str, *, rank: Optional[int] = None, host: Optional[str] = None, **fields
    ) -> None:
        """Print ``[lmforge fault] <event> rank=<r> [host=<h> ]step=<s>: <cause>`` and record the event. ``rank``:
        the rank the event is about when another rank reports it (a straggler, named by rank 0), else this rank;
        ``host``: that rank's host, printed and recorded when given."""
        rank = self.rank if rank is None else rank
        where = f"rank={rank}" + (f" host={host}" if host is not None else "")
        print(f"[lmforge fault] {event} {where} step={step}: {cause}", file=sys.stderr, flush=True)
        if host is not None:
            fields["host"] = host
        if self.logger is not None and self.logger.sinks:
            self.logger.event(event, step=step, rank=rank, cause=cause, **fields)
            return
        if not self.jsonl:
            return
        try:
            direct = MetricsLogger([JsonlSink(self.metrics_path)], rank=self.rank)
        except OSError:
            return
        try:
            direct.event(event, step=step, rank=rank, cause=cause, **fields)
        finally:
            direct.close()

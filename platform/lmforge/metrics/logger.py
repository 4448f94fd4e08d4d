"""Fan records out to the configured sinks. Non-zero ranks get a logger with no sinks."""

from __future__ import annotations

from typing import List, Optional

from lmforge.metrics.sinks import Sink, now


class MetricsLogger:
    def __init__(self, sinks: Optional[List[Sink]] = None, rank: int = 0):
        self.sinks = [s for s in (sinks or []) if s is not None]
        self.rank = rank

    def log(self, record: dict) -> None:
        record = {"time": now(), **record}
        for sink in self.sinks:
            sink.log(record)

    def event(self, event: str, step: int, rank: Optional[int] = None, **fields) -> None:
        """A fault or lifecycle event (restart, requeue, skipped step, straggler, watchdog, ...)."""
        record = {
            "time": now(),
            "kind": "event",
            "event": event,
            "step": step,
            "rank": self.rank if rank is None else rank,
            **fields,
        }
        for sink in self.sinks:
            sink.event(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

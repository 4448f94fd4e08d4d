"""The series names every dashboard sink shares (W&B and TensorBoard): one record -> one row of named numbers.

- A train record's numbers go under ``train/<key>`` (an ``fp8_check`` record's under ``fp8_check/<key>``, the
  goodput record each launch logs at its end under ``goodput/<key>``: fraction, wall_s, <cause>_s); the
  x-axes ``tokens_seen`` and ``flops_seen``, the validation losses ``val/<source>/*``, the downstream task scores
  ``eval/<task>/*``, the per-source token counts ``tokens/<source>`` and the overlap probe's ``comm/*`` keep their
  own names.
- A checkpoint event's numbers go under ``checkpoint/<key>`` (save stall, write time); every other event (restart,
  requeue, preemption checkpoint, skipped step, straggler, watchdog) is a counter ``events/<name>``: how many of
  them this launch has logged.
"""

from __future__ import annotations

from typing import Dict

OWN_NAMES = ("tokens_seen", "flops_seen")
OWN_PREFIXES = ("val/", "eval/", "tokens/", "comm/")  # comm/: the overlap probe's record (comm/profiling.py)
NOT_SERIES = ("kind", "time", "step")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def record_row(record: dict) -> Dict[str, float]:
    """A train, eval or check record's numbers under their series names (empty: nothing to plot)."""
    kind = record.get("kind", "train")
    row = {}
    for key, value in record.items():
        if key in NOT_SERIES or not _number(value):
            continue
        row[key if key in OWN_NAMES or key.startswith(OWN_PREFIXES) else f"{kind}/{key}"] = value
    return row


class EventCounter:
    """Events as series: a checkpoint event's numbers, a running count for every other event name."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}

    def row(self, record: dict) -> Dict[str, float]:
        name = str(record.get("event", ""))
        if name.startswith("checkpoint"):
            return {f"checkpoint/{k}": v for k, v in record.items() if _number(v) and k not in ("step", "time", "rank")}
        self.counts[name] = self.counts.get(name, 0) + 1
        return {f"events/{name}": self.counts[name]}

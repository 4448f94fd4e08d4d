"""Where metrics go. Each sink gets the same record dicts; only rank 0 creates sinks (see ``MetricsLogger``)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Protocol

from lmforge.runtime.file_modes import open_append
from lmforge.runtime.secrets import redact

# Records the console shows elsewhere: goodput in fault/goodput.py's summary line, the comm preflight as its table.
NOT_ON_CONSOLE = ("goodput", "comm_bench")


class Sink(Protocol):
    def log(self, record: dict) -> None: ...
    def event(self, record: dict) -> None: ...
    def close(self) -> None: ...


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if hasattr(v, "item"):
        return _jsonable(v.item())
    return v


class JsonlSink:
    """One JSON object per line in ``metrics.jsonl``; ``kind`` tells train / eval / event / summary records."""

    def __init__(self, path: Path):
        self.fh = open_append(path, buffering=1)

    def _write(self, record: dict) -> None:
        self.fh.write(json.dumps(redact({k: _jsonable(v) for k, v in record.items()}), sort_keys=True) + "\n")

    def log(self, record: dict) -> None:
        self._write(record)

    def event(self, record: dict) -> None:
        self._write(record)

    def close(self) -> None:
        self.fh.close()


def _fmt(record: dict) -> str:
    parts = [f"step {record.get('step', '?')}"]
    for key, label, spec in (
        ("loss", "loss", ".4f"),
        ("lr", "lr", ".2e"),
        ("grad_norm", "gnorm", ".3f"),
        ("tokens_per_s", "tok/s", ",.0f"),
        ("mfu", "mfu", ".1%"),
        ("step_time_s", "step", ".3fs"),
        # MoE runs (model/moe.py): router aux loss, the most loaded expert vs the mean, drops
        ("moe/aux_loss", "moe aux", ".3f"),
        ("moe/load_max_over_mean", "load max/mean", ".2f"),
        ("moe/dropped", "dropped", ".2%"),
        ("fp8/loss_gap", "fp8 gap", "+.4f"),  # train.fp8.check_every: float8 - bf16 loss on the check batch
    ):
        if key in record:
            value = record[key]
            parts.append(f"{label} {format(value, spec[:-1]) + 's' if spec.endswith('s') else format(value, spec)}")
    return " | ".join(parts)


def event_line(record: dict, with_rank: bool) -> str:
    """An event on the console: its name, step (and rank), then its cause and its path when it has them."""
    parts = [str(record.get("event")), f"step={record.get('step')}"]
    if with_rank:
        parts.append(f"rank={record.get('rank')}")
    if record.get("cause"):
        parts.append(str(record["cause"]))
    if record.get("path"):
        parts.append(f"path={record['path']}")
    return " ".join(parts)


def eval_line(record: dict, digits: int = 4) -> str:
    """The console's line for a ``kind: "eval"`` record: the ``val/*`` losses and bits per byte, then each
    downstream task's accuracies, ``eval/<task>/acc`` shown as ``<task>_acc`` (log-likelihoods stay in the files)."""
    vals = [f"{k}={v:.{digits}f}" for k, v in record.items() if k.startswith("val/")]
    for key, value in record.items():
        task, _, metric = key.removeprefix("eval/").rpartition("/")
        if key.startswith("eval/") and task and metric in ("acc", "acc_norm"):
            vals.append(f"{task}_{metric}={value:.3f}")
    return f"eval step {record['step']}: " + " ".join(vals)


def overlap_line(record: dict) -> str:
    """The console's line for the overlap probe's record (``kind: "overlap"``, comm/profiling.py)."""
    fraction = record.get("comm/overlap_fraction")
    shown = f"{fraction:.2f}" if fraction is not None else "n/a"
    return (
        f"overlap step {record.get('step')}: fraction {shown}, exposed {record.get('comm/exposed_ms', 0.0):.1f} ms "
        f"of {record.get('comm/total_ms', 0.0):.1f} ms communication (profiled step, left out of tokens/s)"
    )


def fp8_check_line(record: dict, digits: int = 4) -> str:
    """The console's line for the float8 numerics check (``kind: "fp8_check"``, parallel/float8.py)."""
    return (
        f"fp8 check step {record.get('step')}: loss {record.get('fp8/loss', float('nan')):.{digits}f} against bf16 "
        f"{record.get('fp8/bf16_loss', float('nan')):.{digits}f} (gap {record.get('fp8/loss_gap', float('nan')):+.{digits}f})"
    )


def own_line(record: dict, digits: int = 4) -> Optional[str]:
    """The line of a record the console shows apart from the step lines (eval, overlap, fp8 check); None for the
    others."""
    kind = record.get("kind")
    if kind == "eval":
        return eval_line(record, digits)
    if kind == "overlap":
        return overlap_line(record)
    if kind == "fp8_check":
        return fp8_check_line(record, digits)
    return None


class PlainConsoleSink:
    def __init__(self, stream=None):
        self.stream = stream or sys.stdout

    def log(self, record: dict) -> None:
        if record.get("kind") in NOT_ON_CONSOLE:
            return
        line = own_line(record)
        print(line if line is not None else _fmt(record), file=self.stream, flush=True)

    def event(self, record: dict) -> None:
        print(f"[event] {event_line(record, with_rank=True)}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichConsoleSink:
    """A rich progress bar with loss, tokens/s and MFU (interactive terminals)."""

    def __init__(self, total_steps: int, start_step: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            refresh_per_second=4,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
        self.progress.start()

    def log(self, record: dict) -> None:
        if record.get("kind") in NOT_ON_CONSOLE:
            return
        line = own_line(record, digits=3)
        if line is not None:
            self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        info = (
            f"loss {record.get('loss', float('nan')):.4f} | {record.get('tokens_per_s', 0):,.0f} tok/s | "
            f"MFU {record.get('mfu', 0):.1%}"
        )
        self.progress.update(self.task, completed=record.get("step", 0), info=info)

    def event(self, record: dict) -> None:
        from rich.markup import escape

        self.progress.console.print(f"[yellow]event[/] {escape(event_line(record, with_rank=False))}")

    def close(self) -> None:
        self.progress.stop()


def make_console_sink(mode: str, total_steps: int, start_step: int) -> Optional[Sink]:
    if mode == "none":
        return None
    interactive = sys.stdout.isatty()
    if mode == "rich" or (mode == "auto" and interactive):
        return RichConsoleSink(total_steps, start_step)
    return PlainConsoleSink()


def now() -> float:
    return time.time()

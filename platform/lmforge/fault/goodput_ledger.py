"""Where each second of a launch went, written as it happens: ``<run>/goodput/launch-NNN.jsonl`` (rank 0).

One line when the loop starts, one per step, one when the launch ends (if it lives to write it)::

    {"kind": "start", "launch": 1, "process_start": T, "loop_start": T, "start_step": 300, "load_s": 4.1, ...}
    {"s": 301, "t": T, "d": 0.52, "w": 0.01}              # step, end time, iteration seconds, data wait
    {"s": 310, "t": T, "d": 3.90, "w": 0.01, "e": 3.1}    # ... of which evaluation (e), checkpoint stall (c);
    {"s": 320, "t": T, "d": 0.61, "p": 1}                 # p: a profiled step
    {"s": 321, "t": T, "d": 0.20, "w": 0.01, "n": 65536}  # n: its tokens, where not tokens_per_step (batch ramp)
    {"s": 322, "t": T, "d": 1.10, "w": 0.02, "u": 1}      # u: not committed (replica FT: redone with the next quorum)
    {"s": 322, "t": T, "d": 1.05, "w": 0.02, "r": 2}      # r: committed with 2 of the start line's "replicas" groups
    {"s": 340, "t": T, "d": 2.30, "w": 1.3, "h": 12, "hs": 1.2}  # h: healed from a peer at step 12 to 339, in hs s
    {"kind": "end", "t": T, "step": 400, "reason": "done", "final_save_s": 2.0}

Each line is one short append (line-buffered), so a launch killed with SIGKILL leaves every step it finished. The
times are the host's: no device synchronisation is added (on a GPU a step's host time includes waiting for the
device whenever the host runs ahead, so the per-step seconds still sum to the loop's wall time). The
accounting that turns these files into ``goodput.json`` is ``fault/goodput.py``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional, TextIO

from lmforge.runtime.file_modes import make_dir, open_append

IMPORT_TIME = time.time()  # the fallback process start where /proc is not there


def process_start_time() -> float:
    """This process's start as a wall-clock time (Linux: /proc; elsewhere the time lmforge was imported).

    /proc/self/stat gives the start in clock ticks since boot; the boot's wall-clock time is taken as now less
    CLOCK_BOOTTIME, not /proc/stat's ``btime``, which is whole seconds (up to 1 s early: enough to place a
    restarted process before the watchdog firing that caused the restart)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return IMPORT_TIME


_RUNS_BEGUN = 0
_RUN_START: Optional[float] = None


def begin_run() -> None:
    """Called where a run begins (``trainer.startup.train``): a process's first run starts with the process (its
    imports are start-up too); a later run in the same process (a sweep worker training its points one after
    another) starts now, not at the process's start."""
    global _RUNS_BEGUN, _RUN_START
    if _RUNS_BEGUN:
        _RUN_START = time.time()
    _RUNS_BEGUN += 1


def run_start_time() -> float:
    """When this run began: the process's start, or ``begin_run``'s time for a process's second and later runs."""
    return _RUN_START if _RUN_START is not None else process_start_time()


def ledger_path(goodput_dir: Path, launch: int) -> Path:
    return goodput_dir / f"launch-{launch:03d}.jsonl"


class GoodputLedger:
    """Rank 0's per-launch time ledger; other ranks get a ledger that writes nothing (``enabled=False``)."""

    def __init__(self, goodput_dir: Path, launch: int, enabled: bool = True):
        self.path = ledger_path(goodput_dir, launch)
        self.launch = launch
        self.enabled = enabled
        self._fh: Optional[TextIO] = None
        self._eval_s = 0.0
        self._save_s = 0.0
        self._tokens_per_step = 0
        self._replicas = 0
        self._healed: Optional[tuple] = None  # (the step before the heal, its seconds), written with the next step

    def _write(self, record: dict) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
        except (OSError, ValueError):  # a full or vanished disk never stops training
            self._fh = None

    def start(
        self, *, start_step: int, load_s: float, tokens_per_step: int, world_size: int, replicas: int = 0
    ) -> None:
        """The loop starts now: everything since the run began (``run_start_time``) was start-up (of which ``load_s``
        the resume).
        ``replicas``: ``fault.replica_groups`` under replica fault tolerance (0 without it)."""
        if not self.enabled:
            return
        make_dir(self.path.parent)
        self._tokens_per_step = tokens_per_step
        self._replicas = replicas
        self._fh = open_append(self.path, buffering=1)
        self._write(
            {
                "kind": "start",
                "launch": self.launch,
                "process_start": run_start_time(),
                "loop_start": time.time(),
                "start_step": start_step,
                "load_s": load_s,
                "tokens_per_step": tokens_per_step,
                "world_size": world_size,
                "host": socket.gethostname(),
                **({"replicas": replicas} if replicas else {}),
            }
        )

    def add_eval(self, seconds: float) -> None:
        """Evaluation seconds inside the current iteration."""
        self._eval_s += seconds

    def add_save(self, seconds: float) -> None:
        """Checkpoint seconds the loop waited for inside the current iteration (the save's stall)."""
        self._save_s += seconds

    def healed(self, from_step: int, seconds: float) -> None:
        """Replica FT: this iteration's quorum healed the group from a peer (it was at ``from_step``; the steps up to
        the peer's are not its own), taking ``seconds`` (inside the iteration's data wait); written with its line."""
        self._healed = (from_step, seconds)

    def step(
        self,
        step: int,
        seconds: float,
        data_wait_s: float,
        *,
        profiled: bool = False,
        tokens: int = 0,
        committed: bool = True,
        participants: int = 0,
    ) -> None:
        """Iteration ``step`` ended now after ``seconds`` (its data wait, evaluation and save stall included);
        ``tokens``: the step's tokens over all ranks, written (``n``) only where they differ from the start line's
        ``tokens_per_step`` (a batch ramp's smaller steps). Replica FT: ``committed`` False for a step no group
        committed (``u``); ``participants``: the groups it committed with, written (``r``) when fewer than
        ``replicas``."""
        if self._fh is not None:
            line = {"s": step, "t": time.time(), "d": round(seconds, 6), "w": round(data_wait_s, 6)}
            if tokens and tokens != self._tokens_per_step:
                line["n"] = tokens
            if not committed:
                line["u"] = 1
            elif participants and participants < self._replicas:
                line["r"] = participants
            if self._healed is not None:
                line["h"], line["hs"] = self._healed[0], round(self._healed[1], 6)
            if self._eval_s:
                line["e"] = round(self._eval_s, 6)
            if self._save_s:
                line["c"] = round(self._save_s, 6)
            if profiled:
                line["p"] = 1
            self._write(line)
        self._eval_s = self._save_s = 0.0
        self._healed = None

    def end(self, step: int, reason: str, final_save_s: float = 0.0) -> None:
        """The launch ends (``reason``: done, stopped, preempted, or the exception that ended it)."""
        if self._fh is None:
            return
        self._write({"kind": "end", "t": time.time(), "step": step, "reason": reason, "final_save_s": final_save_s})
        self.close()

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
        self._fh = None

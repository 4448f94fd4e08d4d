"""Hang watchdog and orphan check: a per-rank heartbeat thread.

The trainer calls ``beat(step)`` around every step. A daemon thread wakes every ``poll_s``:

* no beat for ``timeout_s`` (``startup_s`` before the first step) -> write every thread's Python stack
  (``faulthandler``) and, on CUDA, the NCCL flight recorder to ``<run>/dumps/``, record a ``watchdog`` event
  and ``os._exit(43)`` so torchrun restarts the group from the last checkpoint;
* the parent process changed (the torchrun agent died and this worker was re-parented) -> record an
  ``orphaned`` event and ``os._exit(44)`` instead of training on unobserved.

A blocked collective releases the GIL, so the thread runs. As a backstop for code that holds the GIL,
``faulthandler.dump_traceback_later`` (a C thread) dumps to stderr and exits ``backstop_s`` after the
Python watchdog should have fired. The thread also refreshes ``<run>/heartbeats/rank<r>.json`` (pid, host,
step, time), which operators and tests use to find a rank's process.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from lmforge.fault.exitcodes import ORPHAN_EXIT_CODE, WATCHDOG_EXIT_CODE
from lmforge.runtime.env_vars import slurm_job_id, torchrun_restart_count
from lmforge.runtime.file_modes import make_dir, open_write, write_text


class Watchdog:
    def __init__(
        self,
        rank: int,
        timeout_s: float,
        dumps_dir: Path,
        heartbeat_dir: Optional[Path] = None,
        startup_s: float = 0.0,
        poll_s: float = 1.0,
        orphan_check: bool = True,
        on_event: Optional[Callable[..., None]] = None,
        flight_recorder: bool = False,
        backstop_s: float = 60.0,
        exit: Callable[[int], None] = os._exit,
    ):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.startup_s = float(startup_s)
        self.poll_s = float(poll_s)
        self.dumps_dir = Path(dumps_dir)
        self.heartbeat_dir = Path(heartbeat_dir) if heartbeat_dir else None
        self.orphan_check = orphan_check
        self.on_event = on_event or (lambda *a, **k: None)
        self.flight_recorder = flight_recorder
        self.backstop_s = backstop_s
        self._exit = exit
        self.parent_pid = os.getppid()
        self.step = 0
        self.last_beat = time.monotonic()
        self.first_beat_seen = False
        self.paused = False
        self.fired: Optional[str] = None
        self._armed_at: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- used by the trainer --------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self.last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"lmforge-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()
        self._arm_backstop(self.startup_s + self.timeout_s)
        return self

    def beat(self, step: int) -> None:
        self.step = step
        self.last_beat = time.monotonic()
        self.first_beat_seen = True
        self._arm_backstop(self.timeout_s)

    def pause(self) -> None:
        """Stop judging this rank (e.g. while it deliberately waits); the orphan check stays on."""
        self.paused = True
        self._armed_at = None
        faulthandler.cancel_dump_traceback_later()

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.poll_s + 1)

    # ---- internals ------------------------------------------------------------------------------------
    def _arm_backstop(self, seconds: float) -> None:
        """(Re-)arm the C-level timer. Re-arming restarts a thread, so it is done at most every timeout/4:
        the hard deadline stays at least ``0.75 * timeout + backstop_s`` after the newest beat."""
        if self.timeout_s <= 0 or self.paused or self.backstop_s <= 0:
            return
        now = time.monotonic()
        if self._armed_at is not None and now - self._armed_at < min(30.0, self.timeout_s / 4):
            return
        self._armed_at = now
        faulthandler.dump_traceback_later(seconds + self.backstop_s, repeat=False, file=sys.stderr, exit=True)

    def allowance(self) -> float:
        return self.timeout_s + (0.0 if self.first_beat_seen else self.startup_s)

    def check(self, now: Optional[float] = None) -> Optional[str]:
        """One watchdog decision: None (healthy), 'orphaned' or 'watchdog'."""
        if self.orphan_check and os.getppid() != self.parent_pid:
            return "orphaned"
        if self.timeout_s > 0 and not self.paused:
            idle = (time.monotonic() if now is None else now) - self.last_beat
            if idle > self.allowance():
                return "watchdog"
        return None

    def _run(self) -> None:
        last_file_write = 0.0
        while not self._stop.wait(self.poll_s):
            verdict = self.check()
            if verdict == "orphaned":
                self.fired = verdict
                self.on_event(
                    "orphaned",
                    self.step,
                    f"parent pid {self.parent_pid} is gone (now {os.getppid()}); "
                    f"the launcher died, exiting instead of training on as an orphan",
                )
                self._exit(ORPHAN_EXIT_CODE)
                return
            if verdict == "watchdog":
                self.fired = verdict
                idle = time.monotonic() - self.last_beat
                path = self.dump(
                    f"no heartbeat for {idle:.1f}s (timeout {self.allowance():.0f}s) after step {self.step}"
                )
                self.on_event(
                    "watchdog",
                    self.step,
                    f"rank {self.rank} stuck for {idle:.1f}s after step {self.step} "
                    f"(timeout {self.allowance():.0f}s); stacks in {path}",
                    dump=str(path),
                    idle_s=idle,
                )
                self._exit(WATCHDOG_EXIT_CODE)
                return
            now = time.monotonic()
            if self.heartbeat_dir is not None and now - last_file_write >= 5 * self.poll_s:
                last_file_write = now
                self.write_heartbeat()

    def write_heartbeat(self) -> None:
        if self.heartbeat_dir is None:
            return
        try:
            make_dir(self.heartbeat_dir)
            tmp = self.heartbeat_dir / f".rank{self.rank}.json.tmp"
            write_text(
                tmp,
                json.dumps(
                    {
                        "rank": self.rank,
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "step": self.step,
                        "time": time.time(),
                        "restart": torchrun_restart_count(),
                    }
                ),
            )
            os.replace(tmp, self.heartbeat_dir / f"rank{self.rank}.json")
        except OSError:
            pass

    def dump(self, reason: str) -> Path:
        """All Python stacks of this process (and the NCCL flight recorder on CUDA) into the dumps folder."""
        make_dir(self.dumps_dir)
        attempt = torchrun_restart_count()
        job = slurm_job_id() or "local"
        path = self.dumps_dir / f"watchdog-rank{self.rank}-step{self.step}-job{job}-attempt{attempt}.txt"
        with open_write(path) as fh:
            fh.write(
                f"lmforge watchdog: rank {self.rank} pid {os.getpid()} host {socket.gethostname()}\n"
                f"reason: {reason}\n\n"
            )
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)
        if self.flight_recorder:
            self._dump_flight_recorder()
        return path

    def _dump_flight_recorder(self) -> None:
        try:  # private torch API; present in builds with NCCL, absent on CPU wheels
            from torch._C._distributed_c10d import _dump_nccl_trace  # type: ignore[attr-defined]

            (self.dumps_dir / f"nccl-flight-recorder-rank{self.rank}.pkl").write_bytes(_dump_nccl_trace())
        except Exception as e:  # noqa: BLE001
            print(f"[lmforge fault] no NCCL flight recorder dump: {e}", file=sys.stderr, flush=True)

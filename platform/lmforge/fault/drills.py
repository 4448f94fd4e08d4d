"""Fault drills: inject a real fault at a chosen step (``fault.drill.*``) to rehearse recovery.

* kill: ``SIGKILL`` to this very process (nothing runs after it, exactly like the OOM killer);
* hang: this rank withholds its next collective for ``hang_s`` seconds (its own watchdog is paused, so
  the *peers*, blocked inside the collective, are the ones whose watchdog fires and dumps stacks);
* step_sleep_s: a pause after every step, so an operator (or a test) can act while the run is going.

A drill only fires on its configured torchrun attempt of the first Slurm run, so the recovered run trains on.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Optional

from lmforge.config.fault import DrillConfig


def current_attempt() -> Optional[int]:
    """The torchrun attempt of the first Slurm run, or None on a requeued Slurm run (no drills there)."""
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return None
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Drills:
    def __init__(self, cfg: DrillConfig, rank: int, on_event: Callable[..., None], pause_watchdog: Callable[[], None],
                 stop_requested: Callable[[], bool] = lambda: False):
        self.cfg = cfg
        self.stop_requested = stop_requested
        self.rank = rank
        self.on_event = on_event
        self.pause_watchdog = pause_watchdog
        self.attempt = current_attempt()

    def after_step(self, step: int) -> None:
        cfg = self.cfg
        if cfg.step_sleep_s > 0:
            time.sleep(cfg.step_sleep_s)
        if self.attempt is None:
            return
        if cfg.kill_step and step == cfg.kill_step and self.rank == cfg.kill_rank and self.attempt == cfg.kill_attempt:
            self.on_event("drill", step, f"drill: SIGKILL rank {self.rank} after step {step}")
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.hang_step and step == cfg.hang_step and self.rank == cfg.hang_rank and self.attempt == cfg.hang_attempt:
            self.on_event("drill", step, f"drill: rank {self.rank} withholds its next collective for {cfg.hang_s}s")
            self.pause_watchdog()
            deadline = time.monotonic() + cfg.hang_s
            while time.monotonic() < deadline:
                if self.stop_requested():  # the launcher is tearing the group down (SIGTERM): end the drill
                    os._exit(128 + signal.SIGTERM)
                time.sleep(0.05)

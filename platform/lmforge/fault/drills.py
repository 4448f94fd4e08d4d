"""Fault drills: inject a real fault at a chosen step (``fault.drill.*``) to rehearse recovery.

* kill: ``SIGKILL`` to this very process (nothing runs after it, exactly like the OOM killer), on the first
  ``kill_times`` attempts that reach it (0: every attempt);
* hang: this rank withholds its next collective for ``hang_s`` seconds (its own watchdog is paused, so
  the *peers*, blocked inside the collective, are the ones whose watchdog fires and dumps stacks);
* crash: this rank raises an exception (``DrillCrash``) after the step, on the first ``crash_times`` attempts
  that reach it (0: every attempt: a crash that recurs, for the repeated-crash rule, fault/verdict.py);
* step_sleep_s: a pause after every step, so an operator (or a test) can act while the run is going;
* slow_s: rank ``slow_rank`` (or every rank on host ``slow_host``: a slow node) does ``slow_s`` seconds of extra
  compute (small matmuls) before every step, a straggler for the straggler detector to find;
* bitflip: one bit of one parameter flipped in place on one rank (silent data corruption, caught by the replica
  consistency check of fault/consistency.py; under fault.replica_ft=torchft on one rank of one replica group, caught
  by the check across groups of fault/group_check.py).

Each drill fires once per run directory: the firing rank writes ``<run>/drills/<drill>`` first, so the run that
recovers from it (torchrun restart, Slurm requeue; ranks may be renumbered) trains on.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from lmforge.config.fault import DrillConfig
from lmforge.fault.consistency import INT_OF_WIDTH, local_tensor
from lmforge.runtime.file_modes import FILE_MODE, make_dir


class DrillCrash(RuntimeError):
    """The exception of the crash drill (an ordinary crash: a traceback, exit 1)."""


class Drills:
    """Called by the trainer around every step (``FaultHooks.before_step`` and ``after_step``)."""

    def __init__(
        self,
        cfg: DrillConfig,
        rank: int,
        ledger: Path,
        on_event: Callable[..., None],
        pause_watchdog: Callable[[], None],
        stop_requested: Callable[[], bool],
        parameters: Callable[[], Iterable[Tuple[str, torch.Tensor]]],
        replica: Optional[int] = None,
    ):
        """``replica``: this process's torchft replica group (fault.replica_id) under fault.replica_ft=torchft, whose
        rank ``bitflip_rank`` of group ``bitflip_replica`` alone flips a bit; None: no replica groups."""
        self.cfg = cfg
        self.replica = replica
        self.parameters = parameters
        self.ledger = ledger
        self.stop_requested = stop_requested
        self.rank = rank
        self.on_event = on_event
        self.pause_watchdog = pause_watchdog

    def before_step(self, step: int) -> None:
        cfg = self.cfg
        if cfg.slow_s > 0 and (socket.gethostname() == cfg.slow_host if cfg.slow_host else self.rank == cfg.slow_rank):
            work = torch.ones(64, 64)
            deadline = time.perf_counter() + cfg.slow_s
            while time.perf_counter() < deadline:
                work = torch.mm(work, work).clamp_(-1.0, 1.0)

    def after_step(self, step: int) -> None:
        cfg = self.cfg
        if cfg.step_sleep_s > 0:
            time.sleep(cfg.step_sleep_s)
        if cfg.kill_step and step == cfg.kill_step and self.rank == cfg.kill_rank and self._claim_kill():
            self.on_event("drill", step, f"drill: SIGKILL rank {self.rank} after step {step}")
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.crash_step and step == cfg.crash_step and self.rank == cfg.crash_rank and self._claim_crash():
            self.on_event("drill", step, f"drill: rank {self.rank} raises an exception after step {step}")
            raise DrillCrash(f"drill: crash on rank {self.rank} after step {step}")
        if cfg.hang_step and step == cfg.hang_step and self.rank == cfg.hang_rank and self._first_time("hang"):
            self.on_event("drill", step, f"drill: rank {self.rank} withholds its next collective for {cfg.hang_s}s")
            self.pause_watchdog()
            deadline = time.monotonic() + cfg.hang_s
            while time.monotonic() < deadline:
                if self.stop_requested():  # the launcher is tearing the group down (SIGTERM): end the drill
                    os._exit(128 + signal.SIGTERM)
                time.sleep(0.05)

        if (
            cfg.bitflip_step
            and step == cfg.bitflip_step
            and self.rank == cfg.bitflip_rank
            and (self.replica is None or self.replica == cfg.bitflip_replica)
            and self._first_time("bitflip")
        ):
            name = flip_bit(self.parameters(), cfg.bitflip_param, cfg.bitflip_bit)
            self.on_event(
                "drill", step, f"drill: rank {self.rank} flipped bit {cfg.bitflip_bit} of {name}[0] after step {step}"
            )

    def _claim_kill(self) -> bool:
        """True if the kill drill fires in this attempt (ledger ``kill``, then ``kill-1``, ... up to kill_times)."""
        return self._claim(self.cfg.kill_times, ["kill", *(f"kill-{i}" for i in range(1, self.cfg.kill_times))])

    def _claim_crash(self) -> bool:
        """True if the crash drill fires in this attempt (``crash-0``, ``crash-1``, ... up to crash_times)."""
        return self._claim(self.cfg.crash_times, [f"crash-{i}" for i in range(self.cfg.crash_times)])

    def _claim(self, times: int, names: List[str]) -> bool:
        """A drill that fires on its first ``times`` attempts (0: on every attempt): True while one of its ledger
        entries ``names`` (one per firing) is still unclaimed, claiming it."""
        return times <= 0 or any(self._first_time(name) for name in names)

    def _first_time(self, name: str) -> bool:
        """Claim drill ``name`` for this run; False if it already fired (in an earlier attempt)."""
        make_dir(self.ledger)
        try:
            fd = os.open(self.ledger / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
        except FileExistsError:
            return False
        os.fchmod(fd, FILE_MODE)
        os.write(fd, f"{time.time()} pid {os.getpid()}\n".encode())
        os.fsync(fd)
        os.close(fd)
        return True


@torch.no_grad()
def flip_bit(named: Iterable[Tuple[str, torch.Tensor]], name: str, bit: int) -> str:
    """Flip ``bit`` of the first element of this rank's part of parameter ``name`` ('' = the first); its name."""
    for pname, param in named:
        if name and pname != name:
            continue
        flat = local_tensor(param).view(-1)
        width = INT_OF_WIDTH[flat.element_size()]
        bits, k = flat.view(width), bit % (8 * flat.element_size())
        mask = 1 << k if k < 8 * flat.element_size() - 1 or width is torch.uint8 else -(1 << k)  # the sign bit
        bits[0] = bits[0] ^ mask
        return pname
    raise ValueError(f"fault.drill.bitflip_param={name!r}: no such parameter on rank with the drill")

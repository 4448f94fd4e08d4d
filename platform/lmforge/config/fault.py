"""Schema of the ``fault`` config group (``conf/fault/*.yaml``): watchdog, loss guard, restarts, drills.

The straggler settings live in ``metrics`` (``metrics.straggler_every``, ``metrics.straggler_threshold``);
the job-level retry budget for Slurm lives in ``cluster.max_requeues``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DrillConfig:
    """Fault drills: real faults injected on purpose to rehearse recovery (tests, game days). All off by default.

    A drill fires only on the attempt it names (``TORCHELASTIC_RESTART_COUNT``) of the first Slurm run
    (``SLURM_RESTART_COUNT`` unset or 0), so the recovered run trains on normally.
    """

    # SIGKILL rank ``kill_rank`` right after step ``kill_step`` (0: off).
    kill_step: int = 0
    kill_rank: int = 0
    # After step ``hang_step`` rank ``hang_rank`` withholds its next collective for ``hang_s`` (0: off);
    # its peers block inside that collective until their watchdog fires.
    hang_step: int = 0
    hang_rank: int = 0
    hang_s: float = 600.0
    # Raise an exception on rank ``crash_rank`` right after step ``crash_step`` (0: off), on the first
    # ``crash_times`` attempts that reach that step (0: on every attempt, a crash that always recurs).
    crash_step: int = 0
    crash_rank: int = 0
    crash_times: int = 1
    # Sleep this long after every step (gives an operator or a test time to act mid-run).
    step_sleep_s: float = 0.0
    # Rank ``slow_rank`` does ``slow_s`` seconds of extra compute before every step (a straggler; 0: off).
    slow_rank: int = 0
    slow_s: float = 0.0
    # Right after step ``bitflip_step`` rank ``bitflip_rank`` flips bit ``bitflip_bit`` of the first element of
    # its local part of parameter ``bitflip_param`` ('' = the first parameter): silent data corruption, which
    # the replica consistency check (fault.consistency_every) must catch (0: off).
    bitflip_step: int = 0
    bitflip_rank: int = 0
    bitflip_param: str = ""
    bitflip_bit: int = 12


@dataclass
class FaultConfig:
    name: str = "default"
    # A rank without a heartbeat for this long dumps every Python stack to <run>/dumps and exits (0: off).
    watchdog_timeout_s: float = 900.0
    # Extra allowance before the first step (data index build, compile, first collective).
    watchdog_startup_s: float = 900.0
    watchdog_poll_s: float = 1.0
    # A worker whose launcher (torchrun agent) died exits instead of training on as an orphan.
    orphan_check: bool = True
    # Loss guard: skip the update on a NaN/Inf loss or grad norm, or on a loss above spike_factor x the
    # running mean of the last spike_window stepped losses (spike_factor 0: NaN/Inf only).
    loss_guard: bool = True
    spike_factor: float = 0.0
    spike_window: int = 20
    # Stop (with a reference to the last checkpoint before the divergence, pinned) after this many
    # skipped steps in a row.
    max_consecutive_skips: int = 5
    # Every this many steps, data-parallel replicas compare exact fingerprints of their parameters and optimizer
    # state (fault/consistency.py); a mismatch stops the run with exit 47 and the last checkpoint before it (0: off).
    consistency_every: int = 1000
    # torchrun --max_restarts for in-job restarts (lmforge launch and slurm/train.sh).
    max_restarts: int = 3
    drill: DrillConfig = field(default_factory=DrillConfig)

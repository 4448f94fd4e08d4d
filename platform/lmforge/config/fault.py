"""Schema of the ``fault`` config group (``conf/fault/*.yaml``): watchdog, loss guard, restarts, drills, replica FT.

The straggler settings live in ``metrics`` (``metrics.straggler_every``, ``metrics.straggler_threshold``);
the job-level retry budget for Slurm lives in ``cluster.max_requeues``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from lmforge.config.ranges import NonNegativeInt, PositiveInt, Range

Seconds = Annotated[float, Range(0, low_open=True, fix="set a number of seconds > 0")]


@dataclass
class DrillConfig:
    """Fault drills: real faults injected on purpose to rehearse recovery (tests, game days). All off by default.

    A drill fires only on the attempt it names (``TORCHELASTIC_RESTART_COUNT``) of the first Slurm run
    (``SLURM_RESTART_COUNT`` unset or 0), so the recovered run trains on normally.
    """

    kill_step: int = 0
    """SIGKILL rank kill_rank right after this step; 0 = off."""
    kill_rank: int = 0
    """The rank kill_step kills."""
    kill_times: int = 1
    """Kill on the first this many attempts that reach kill_step; 0 = on every attempt (an outside kill, such as
    the OOM killer's, that lands at the same step again)."""
    hang_step: int = 0
    """After this step rank hang_rank withholds its next collective for hang_s (its peers block inside that
    collective until their watchdog fires); 0 = off."""
    hang_rank: int = 0
    """The rank hang_step hangs."""
    hang_s: float = 600.0
    """How long the hang lasts."""
    crash_step: int = 0
    """Raise an exception on rank crash_rank right after this step; 0 = off."""
    crash_rank: int = 0
    """The rank crash_step crashes."""
    crash_times: int = 1
    """Crash on the first this many attempts that reach crash_step; 0 = on every attempt (a crash that always
    recurs)."""
    step_sleep_s: float = 0.0
    """Sleep this long after every step (gives an operator or a test time to act mid-run)."""
    slow_rank: int = 0
    """The rank slow_s slows down."""
    slow_s: float = 0.0
    """Extra compute seconds rank slow_rank does before every step (a straggler); 0 = off."""
    slow_host: str = ""
    """When set, slow_s slows every rank on the host of this name instead of rank slow_rank (a slow node)."""
    bitflip_step: NonNegativeInt = 0
    """Right after this step rank bitflip_rank flips bit bitflip_bit of the first element of its local part of
    parameter bitflip_param: silent data corruption, which fault.consistency_every must catch; 0 = off."""
    bitflip_rank: int = 0
    """The rank bitflip_step corrupts."""
    bitflip_replica: int = 0
    """fault.replica_ft=torchft: the replica group (fault.replica_id) whose rank bitflip_rank bitflip_step corrupts
    (the other groups' ranks do not flip); ignored otherwise."""
    bitflip_param: str = ""
    """The parameter bitflip_step corrupts; '' = the first parameter."""
    bitflip_bit: int = 12
    """The bit bitflip_step flips."""


@dataclass
class FaultConfig:
    name: str = "default"
    """The preset's name (a conf/fault file name)."""
    watchdog_timeout_s: float = 900.0
    """A rank without a heartbeat for this long dumps every Python stack to <run>/dumps and exits 43; 0 = off. Keep it
    below comm.collective_timeout_s (a hung collective is ended there first) and above a blocking checkpoint save."""
    watchdog_startup_s: float = 900.0
    """Extra watchdog allowance before the first step (data index build, compile, first collective)."""
    watchdog_poll_s: float = 1.0
    """How often the watchdog checks the heartbeat."""
    orphan_check: bool = True
    """A worker whose launcher (torchrun agent) died exits 44 instead of training on as an orphan."""
    loss_guard: bool = True
    """Skip the update on a NaN/Inf loss or grad norm, or on a loss spike (spike_factor)."""
    spike_factor: float = 0.0
    """A loss above spike_factor x the running mean of the last spike_window stepped losses is a spike;
    0 = NaN/Inf only."""
    spike_window: int = 20
    """Stepped losses in the spike detector's running mean."""
    max_consecutive_skips: int = 5
    """Stop (exit 45, the last checkpoint before the divergence pinned) after this many skipped steps in a row."""
    consistency_every: NonNegativeInt = 1000
    """Every this many steps, data-parallel replicas compare exact fingerprints of their parameters and optimizer
    state (fault/consistency.py); a mismatch stops the run with exit 47 and the last checkpoint before it, naming
    the suspect replica's hosts when the check can tell which is wrong (a minority of three or more; the host names
    are gathered once at start): a Slurm job is then requeued without them. 0 = off."""
    exclude_straggler_flags: NonNegativeInt = 3
    """On a Slurm requeue, a node the straggler detector flagged this many times in the run that ended is left out
    of the job's next run (with the nodes Slurm reports unhealthy; lmforge.fault.bad_nodes); 0 = never."""
    max_restarts: int = 3
    """torchrun --max_restarts: in-job restarts (lmforge launch and slurm/train.sh)."""
    replica_ft: Annotated[str, Literal["none", "torchft"]] = "none"
    """Replica-level fault tolerance (fault/replica_ft.py): torchft = this process, or this torchrun launch of
    data-parallel ranks (DDP, FSDP), is one replica group of a torchft job (launchers/torchft_local.sh); a replica that dies is left out of the next quorum while the others
    train on, and a restarted one fetches weights, optimizer, step, data position and RNG from a healthy peer.
    Membership is DYNAMIC: while a replica is down the global batch shrinks to the participating replicas'."""
    replica_groups: PositiveInt = 1
    """replica_ft=torchft: the replica groups the job is planned with (fault.replica_id is below it)."""
    replica_id: NonNegativeInt = 0
    """replica_ft=torchft: this process's (or launch's) replica group, 0..replica_groups-1 (the launcher sets it)."""
    replica_min: PositiveInt = 1
    """replica_ft=torchft: a step commits only with at least this many participating replicas."""
    lighthouse: str = ""
    """replica_ft=torchft: the torchft Lighthouse's address (http://host:port); '' = $TORCHFT_LIGHTHOUSE."""
    replica_timeout_s: Seconds = 60.0
    """replica_ft=torchft: timeout of the cross-replica all-reduce, the commit vote and a recovery transfer
    ($TORCHFT_TIMEOUT_SEC wins when set); a replica that dies mid-step holds its peers this long at most."""
    replica_quorum_timeout_s: Seconds = 60.0
    """replica_ft=torchft: how long a step waits for the Lighthouse's quorum ($TORCHFT_QUORUM_TIMEOUT_SEC wins)."""
    drill: DrillConfig = field(default_factory=DrillConfig)
    """Fault drills (``fault.drill.*``): injected faults for rehearsals and tests."""

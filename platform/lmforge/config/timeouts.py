"""The order a run's clocks fire in: the hang watchdog before the collective timeout, a checkpoint save inside the
watchdog's allowance and Slurm's signal lead. One warning line per ordering that is off.

Four clocks end a stuck or ending run (docs/fault-tolerance.md, *Timeouts*):

- the process-group timeout, the larger of ``comm.init_timeout_s`` and ``comm.collective_timeout_s``
  (``comm/process_group.py``): a collective waiting longer ends the process (gloo raises; NCCL aborts the
  communicator under ``comm.async_error_handling``);
- the hang watchdog, ``fault.watchdog_timeout_s``: a rank without a heartbeat this long writes every Python stack to
  ``<run>/dumps`` and exits 43 (retried);
- Slurm's signal lead, ``cluster.signal_lead_s`` (``sbatch --signal=B:USR1@lead``, which ``lmforge launch --slurm``
  passes and slurm/train.sh's ``#SBATCH`` line holds at its default): the time a job at its time limit has to finish
  its step and commit the preemption checkpoint;
- a checkpoint save, as a resumed run measured it (``MeasuredSave``: its newest ``checkpoint_save`` and
  ``checkpoint_commit`` events, read by ``trainer.entry_checks``): the loop beats no heartbeat while a blocking save
  (synchronous, the preemption and the final checkpoint) runs.

Every ordering checked here leaves a run that trains correctly but loses something when a fault strikes (the stack
dump of a hang, the preemption checkpoint, a save judged a hang), and a measured save time is an estimate of the
next one, so each is a warning (``lmforge: warning: ...``, printed once at start by ``trainer.startup.check_start``),
never a refusal:

- ``fault.watchdog_timeout_s`` not below the process-group timeout, on more than one process, when that timeout
  ends the process (gloo, or NCCL with ``comm.async_error_handling``): a hung collective is ended before the watchdog
  writes the stacks, so the dump that names the stuck rank never happens;
- a measured save not shorter than ``cluster.signal_lead_s``, under Slurm: the job may be killed before its
  preemption checkpoint is committed;
- a measured save not shorter than ``fault.watchdog_timeout_s``: the watchdog would end a blocking save as a hang.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from lmforge.config.schema import RootConfig

WARNING = "lmforge: warning: "
# A suggested timeout leaves this share of headroom: the watchdog at 3/4 of the collective timeout, a lead at 3/2 of
# the measured save (the step that is running and the vote step are still to finish when the signal comes).
HEADROOM = 0.75


@dataclass(frozen=True)
class MeasuredSave:
    """The newest committed checkpoint save a run recorded: its step, how long it took from the start of the save to
    its commit (seconds) and the file it was read from."""

    step: int
    seconds: float
    source: str


def _n(value: float) -> str:
    """A config value as it is written on the command line (900.0 -> 900)."""
    return f"{value:g}"


def _up(seconds: float, to: int = 60) -> int:
    """``seconds`` rounded up to a whole ``to`` (a suggestion a user can type)."""
    return int(math.ceil(seconds / to) * to)


def process_group_timeout(cfg: RootConfig) -> float:
    """The timeout every collective of the process group runs under (``comm/process_group.py``)."""
    return float(max(cfg.comm.init_timeout_s, cfg.comm.collective_timeout_s))


def collective_timeout_ends_process(cfg: RootConfig) -> bool:
    """Whether a collective past the process-group timeout ends the process: gloo raises in the waiting call; NCCL
    aborts the communicator only with ``comm.async_error_handling`` (without it the collective hangs on)."""
    gloo = cfg.comm.backend == "gloo" or (cfg.comm.backend == "auto" and cfg.train.device == "cpu")
    return gloo or cfg.comm.async_error_handling


def watchdog_order(cfg: RootConfig, world_size: Optional[int]) -> Optional[str]:
    """The warning line when the watchdog cannot fire before the collective timeout ends a hung collective."""
    watchdog, group = cfg.fault.watchdog_timeout_s, process_group_timeout(cfg)
    if not world_size or world_size < 2 or watchdog <= 0 or watchdog < group:
        return None
    if not collective_timeout_ends_process(cfg):
        return None
    comm = cfg.comm
    named = (
        f"comm.collective_timeout_s={_n(comm.collective_timeout_s)}"
        if comm.collective_timeout_s >= comm.init_timeout_s
        else f"the process-group timeout {_n(group)} s (comm.init_timeout_s={_n(comm.init_timeout_s)}, the larger of "
        "comm.init_timeout_s and comm.collective_timeout_s)"
    )
    return (
        f"{WARNING}fault.watchdog_timeout_s={_n(watchdog)} is not below {named}: a hung collective ends the processes "
        f"after {_n(group)} s, before the watchdog writes their stacks to <run>/dumps; set fault.watchdog_timeout_s "
        f"below {_n(group)} (e.g. fault.watchdog_timeout_s={_n(int(group * HEADROOM))}) or comm.collective_timeout_s "
        f"above {_n(watchdog)} (e.g. comm.collective_timeout_s={_up(watchdog / HEADROOM)})"
    )


def save_order(cfg: RootConfig, save: MeasuredSave, under_slurm: bool) -> List[str]:
    """The warning lines when a save as long as the measured one would not fit Slurm's signal lead (``under_slurm``)
    or the watchdog's allowance."""
    lines = []
    took = f"{save.seconds:.0f} s at step {save.step}, {save.source}"
    lead = cfg.cluster.signal_lead_s
    if under_slurm and save.seconds >= lead:
        better = _up(save.seconds / HEADROOM)
        lines.append(
            f"{WARNING}cluster.signal_lead_s={_n(lead)} is not longer than this run's newest checkpoint save "
            f"({took}): at the time limit Slurm may kill the job before its preemption checkpoint is committed; set "
            f"cluster.signal_lead_s above {save.seconds:.0f} (e.g. cluster.signal_lead_s={better}; with sbatch "
            f"slurm/train.sh also sbatch --signal=B:USR1@{better})"
        )
    watchdog = cfg.fault.watchdog_timeout_s
    if watchdog > 0 and save.seconds >= watchdog:
        better = _up(save.seconds / HEADROOM)
        group = process_group_timeout(cfg)
        also = (
            f" and comm.collective_timeout_s above it (e.g. comm.collective_timeout_s={_up(better / HEADROOM)})"
            if better >= group
            else ""
        )
        lines.append(
            f"{WARNING}fault.watchdog_timeout_s={_n(watchdog)} is not longer than this run's newest checkpoint save "
            f"({took}): no heartbeat is beaten during a blocking save, so the watchdog ends it as a hang (exit 43) "
            f"before it is committed; set fault.watchdog_timeout_s above {save.seconds:.0f} "
            f"(e.g. fault.watchdog_timeout_s={better}){also}"
        )
    return lines


def timeout_warnings(
    cfg: RootConfig, world_size: Optional[int], save: Optional[MeasuredSave] = None, under_slurm: bool = False
) -> List[str]:
    """Every warning line of the module docstring for this config, world size and measured save (None: none known,
    nothing said about saves)."""
    lines = [line for line in (watchdog_order(cfg, world_size),) if line]
    if save is not None:
        lines += save_order(cfg, save, under_slurm)
    return lines

"""Preemption and time-limit signals: note them, let the trainer finish the step and checkpoint.

SIGUSR1 (Slurm's ``--signal=B:USR1@lead`` forwarded by slurm/train.sh) and SIGTERM set a flag; the
trainer checks it after every step, writes a checkpoint and exits with ``REQUEUE_EXIT_CODE`` so the
launch script requeues the job. A second signal while the checkpoint is being written is recorded and
otherwise ignored: the save is never interrupted half-way.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

from lmforge.runtime.env_vars import under_torchrun

REQUEUE_EXIT_CODE = 42


class PreemptionFlag:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.count = 0

    def install(self, signals=(signal.SIGUSR1, signal.SIGTERM)) -> "PreemptionFlag":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in signals:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.count += 1
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""


def preemption_exit_code() -> int:
    """42 for a plain process (the launch script requeues on it); 0 under torchrun.

    torchrun restarts a worker group on *any* non-zero exit, which would resume training right before the
    time limit. Under torchrun the worker therefore exits 0 without the DONE marker, and the launch script
    (slurm/train.sh, lmforge launch) sees "clean exit, run not done" and requeues (lmforge.fault.retry).
    """
    return 0 if under_torchrun() else REQUEUE_EXIT_CODE

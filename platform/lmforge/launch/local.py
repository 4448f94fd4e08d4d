"""``lmforge launch``: N training processes on this machine under torchrun, with the Slurm script's fault handling.

    lmforge launch --nproc 2 +exp=smoke parallelism=ddp
    lmforge launch --nproc 2 --dry-run model=tiny

torchrun (through lmforge.launch.agent, torchrun with a restart policy) restarts the worker group in-job
(``--max-restarts``, default fault.max_restarts) after a killed or hung rank, but not after a deterministic
failure (a rank's verdict in <run>/verdicts: config/layout/data error, divergence, repeated crash, corrupted
replicas); when torchrun gives up, the launcher applies the same decision as slurm/train.sh
(lmforge.fault.retry, cluster.max_requeues): relaunch a crash within the budget, stop on a deterministic verdict
with its message and exit code. Each attempt starts with the previous attempt's verdicts moved to
verdicts/history.jsonl. SIGTERM/SIGINT to the launcher go to the agent, which stops the workers with SIGTERM:
they checkpoint (lmforge.fault.signals) and the launcher stops.
All relaunches share one rendezvous id, hence one run directory (runs/torchrun-<id>), and resume from it.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


@dataclass
class LocalLaunch:
    nproc: int
    overrides: List[str]
    max_restarts: int = 3
    run_id: str = ""
    port: int = 0
    python: str = sys.executable
    run_dir: str = ""

    def command(self) -> List[str]:
        return [self.python, "-m", "lmforge.launch.agent", "--nnodes=1", f"--nproc_per_node={self.nproc}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{self.port}", f"--rdzv_id={self.run_id}",
                f"--max_restarts={self.max_restarts}", "-m", "lmforge.train", *self.overrides]

    def env(self) -> Dict[str, str]:
        return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1",
                "LMFORGE_RUN_DIR": self.run_dir}


def run(launch: LocalLaunch, max_requeues: int, run_dir: Path) -> int:
    """Run torchrun; relaunch on failure within the retry budget. Returns the final exit code."""
    from lmforge.fault.retry import record
    from lmforge.fault.verdict import archive

    launch.run_dir = str(run_dir)
    stop = {"signal": 0}
    while True:
        archive(run_dir)  # this attempt's verdicts only
        proc = subprocess.Popen(launch.command(), env=launch.env())

        def forward(signum, frame):  # noqa: ARG001
            stop["signal"] = signum
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        try:
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if stop["signal"]:
            print(f"lmforge launch: stopped by {signal.Signals(stop['signal']).name}; resume with the same "
                  f"run directory ({run_dir})", file=sys.stderr)
            return rc or 0
        decision = record(run_dir, rc, False, max_requeues)
        if decision.action == "done":
            return 0
        print(f"lmforge launch: {decision.action}: {decision.reason}", file=sys.stderr, flush=True)
        if decision.action != "requeue":
            return decision.exit_code or rc or 1
        launch.port = free_port()

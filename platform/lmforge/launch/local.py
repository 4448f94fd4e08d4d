"""Local torchrun without Slurm: the Python half of launchers/ and the relaunch loop of ``lmforge launch``.

    lmforge launch --nproc 2 +exp=smoke parallelism=ddp
    lmforge launch --nproc 2 --dry-run model=tiny

``lmforge launch --nproc N`` runs ``launchers/torchrun_local.sh --nproc N ... -- <overrides>``, the script a user
runs by hand, so there is one command line (launchers/common.sh ``lmforge_exec_agent``, which slurm/agent.sh uses
too). The script's torchrun (lmforge.launch.agent, torchrun with a restart policy) restarts the worker group
in-job (``--max-restarts``, default fault.max_restarts) after a killed or hung rank, but not after a
deterministic failure (a rank's verdict in <run>/verdicts: config/layout/data error, divergence, repeated crash,
corrupted replicas); when torchrun gives up, ``lmforge launch`` applies the same decision as slurm/train.sh
(lmforge.fault.retry, cluster.max_requeues): relaunch a crash within the budget, stop on a deterministic verdict
with its message and exit code. Each attempt starts with the previous attempt's verdicts moved to
verdicts/history.jsonl (the script's prepare step). SIGTERM/SIGINT to the launcher go to the agent, which stops
the workers with SIGTERM: they checkpoint (lmforge.fault.signals) and the launcher stops.
All relaunches share one rendezvous id, hence one run directory (runs/torchrun-<id>), and resume from it.

    python -m lmforge.launch.local prepare --nnodes N --node-rank K [--nproc P] [--max-restarts R]
                                           [--rdzv-id ID] [--port P] [--dry-run] -- <hydra overrides>
        the scripts' check before torchrun starts (launchers/common.sh ``lmforge_prepare``): the config, the
        layout for world size N x P and its memory fit (not
        with --dry-run); exit 2 with one line when the run cannot start. Node
        rank 0 then makes the run directory, archives the previous verdicts and builds the data indices. Prints
        ``export`` lines: LMFORGE_RUN_DIR, LMFORGE_NPROC_PER_NODE, LMFORGE_MAX_RESTARTS, LMFORGE_RDZV_ID,
        LMFORGE_RDZV_PORT (a free port when not given), the comm preset's environment, OMP_NUM_THREADS (the
        threads each worker pins: train.threads, else this machine's CPUs / P).
"""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from lmforge.config.errors import ConfigError
from lmforge.fault.retry import record
from lmforge.fault.verdict import archive
from lmforge.launch.jobctl import launch_env, print_exports, split_overrides
from lmforge.runtime.device_contract import DeviceContractError
from lmforge.runtime.rundir import RunPaths, resolve_run_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def launchers_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "launchers"


def run_dir_of(cfg, rdzv_id: str) -> Path:
    """The run directory the workers of rendezvous ``rdzv_id`` resolve (runs/torchrun-<id> unless run.name)."""
    return resolve_run_dir(cfg.run.root, cfg.run.name, cfg.run.sweep_point, env={"TORCHELASTIC_RUN_ID": rdzv_id})


@dataclass
class LocalLaunch:
    nproc: int
    overrides: List[str]
    max_restarts: int = 3
    run_id: str = ""
    port: int = 0
    python: str = sys.executable

    def command(self, dry_run: bool = False) -> List[str]:
        """``launchers/torchrun_local.sh`` with every choice explicit, run by this Python."""
        return [
            "env",
            f"LMFORGE_PYTHON={self.python}",
            "bash",
            str(launchers_dir() / "torchrun_local.sh"),
            "--nproc",
            str(self.nproc),
            "--max-restarts",
            str(self.max_restarts),
            "--rdzv-id",
            self.run_id,
            "--port",
            str(self.port),
            *(["--dry-run"] if dry_run else []),
            "--",
            *self.overrides,
        ]


def run(launch: LocalLaunch, max_requeues: int, run_dir: Path, stop_at_step: Optional[int] = None) -> int:
    """Run the script; relaunch on failure within the retry budget. Returns the final exit code."""
    stop = {"signal": 0}
    while True:
        proc = subprocess.Popen(launch.command())

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
            print(
                f"lmforge launch: stopped by {signal.Signals(stop['signal']).name}; resume with the same "
                f"run directory ({run_dir})",
                file=sys.stderr,
            )
            return rc or 0
        decision = record(run_dir, rc, signalled=False, max_failures=max_requeues, stop_at_step=stop_at_step)
        if decision.action == "done":
            return 0
        print(f"lmforge launch: {decision.action}: {decision.reason}", file=sys.stderr, flush=True)
        if decision.action != "requeue":
            return decision.exit_code or rc or 1
        launch.port = free_port()


def prepare(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from lmforge.config.compose import compose  # deferred: imports omegaconf; this module imports without it

    # deferred: imports omegaconf; this module imports without it
    from lmforge.config.validate import check_parallel_layout, validate

    # deferred: imports omegaconf, torch; this module imports without it
    from lmforge.parallel.planner import check_fits, make_plan

    cfg = validate(compose(list(overrides)))
    nproc = cfg.cluster.gpus_per_node if args.nproc is None else args.nproc
    world = args.nnodes * nproc
    if not args.dry_run:  # a dry run prints the command whatever the world
        check_parallel_layout(cfg, world)
        check_fits(make_plan(cfg, world, peak=1.0))
    rdzv_id = args.rdzv_id or new_run_id()
    run_dir = run_dir_of(cfg, rdzv_id)
    if args.node_rank == 0 and not args.dry_run:
        from lmforge.data.index_build import build_for  # deferred: imports numpy; this module imports without it

        RunPaths(run_dir).make()
        archive(run_dir)  # a new attempt: only its own verdicts decide it
        build_for(cfg)  # every megatron-core index, built before any rank waits in a collective
    env = launch_env(cfg, run_dir, nproc)
    env.update(
        {
            "LMFORGE_RDZV_ID": rdzv_id,
            "LMFORGE_MAX_RESTARTS": str(cfg.fault.max_restarts if args.max_restarts is None else args.max_restarts),
            "LMFORGE_RDZV_PORT": str(args.port or free_port()),
        }
    )
    print_exports(env)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    a = argparse.ArgumentParser(prog="python -m lmforge.launch.local")
    a.add_argument("cmd", choices=["prepare"])
    a.add_argument("--nnodes", type=int, required=True)
    a.add_argument("--node-rank", type=int, required=True)
    a.add_argument("--nproc", type=int, default=None)
    a.add_argument("--max-restarts", type=int, default=None)
    a.add_argument("--rdzv-id", default="")
    a.add_argument("--port", type=int, default=0)
    a.add_argument("--dry-run", action="store_true")
    args = a.parse_args(argv)

    try:
        return prepare(args, overrides)
    except (ConfigError, DeviceContractError) as e:
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""A torchft job on this machine (``fault.replica_ft=torchft``): a Lighthouse and N replica groups, restarted.

    python -m lmforge.launch.replica_ft --replicas 3 --name ft-demo -- model=tiny train.max_steps=50
    launchers/torchft_local.sh --replicas 3 --name ft-demo -- model=tiny train.max_steps=50
    launchers/torchft_local.sh --replicas 2 --nproc-per-group 2 --name ft-fsdp -- model=tiny parallelism=fsdp

The Lighthouse (torchft's ``torchft_lighthouse``) binds 127.0.0.1:--port; replica group i is one
``python -m lmforge.train`` process (``--nproc-per-group 1``) or one torchrun launch of K ranks
(``python -m lmforge.launch.agent --nproc-per-node K``: torchrun with lmforge's exit codes; its rendezvous at
127.0.0.1:(--group-port + i), or a free port at each start with ``--group-port 0``; no restarts of its own), with ``run.name=<name>/replica-<i>`` and the
``fault.replica_*`` keys set; the layout inside a group is the overrides' (DDP, FSDP, TP, TP x FSDP).
A group that exits non-zero (a torchrun launch does when any of its ranks dies) is started again (up to --max-restarts times each; never after exit 2, a config
error that would recur) and heals from a healthy peer (lmforge.fault.replica_ft). Under
``<run.root>/<name>/replica_ft/``: ``lighthouse.log``, ``replica-<i>.log`` (every attempt's output appended) and
``launcher.jsonl`` (each start and exit: replica, attempt, pid, return code, time); at the end ``<name>/goodput.json``,
the job's goodput over its groups (fault/goodput_job.py). The launcher exits 0 once every
group has finished, else with the first failing group's last return code; on SIGTERM it sends SIGTERM to every
group (their preemption path) and the Lighthouse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, NoReturn, Optional, Sequence

from lmforge.fault.goodput_job import announce_job_goodput

CONFIG_ERROR = 2  # lmforge's exit code for bad input: restarting cannot help


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the script to read, and exit 2, before anything
    starts (``script``: its path in the repository)."""

    def __init__(self, *args, script: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.script = script

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}. Fix: see the options at the top of {self.script}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


def majority_or_refuse(p: OneLineParser, args: argparse.Namespace) -> None:
    """``--min-replicas`` defaults to a majority of ``--replicas``; a minority is refused (split brain)."""
    if args.min_replicas is None:
        args.min_replicas = args.replicas // 2 + 1
    if args.replicas < 1 or not args.replicas // 2 < args.min_replicas <= args.replicas:
        p.error(
            f"--min-replicas {args.min_replicas} is not a majority of --replicas {args.replicas} (more than half, at "
            "most all): two disjoint quorums would commit the same step with different weights"
        )


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = OneLineParser(prog="torchft_local.sh", description=__doc__.split("\n")[0], script="launchers/torchft_local.sh")
    p.add_argument("--replicas", type=int, required=True, help="replica groups")
    p.add_argument("--nproc-per-group", type=int, default=1, help="ranks of each replica group (torchrun when > 1)")
    p.add_argument(
        "--group-port",
        type=int,
        help="group i's torchrun rendezvous port is this + i (default: --port + 1); 0: a free port at each start",
    )
    p.add_argument("--min-replicas", type=int, help="a step commits with at least this many (default: a majority)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of each replica group")
    p.add_argument("--name", default=f"torchft-{time.strftime('%Y%m%d-%H%M%S')}", help="the run's name in run.root")
    p.add_argument("--port", type=int, default=29510, help="the Lighthouse's port on 127.0.0.1")
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=30000,
        help="how long a quorum waits for a live (heartbeating) group to join; keep it above a step's time, or "
        "the group that arrives last is left out of every other quorum and heals each time",
    )
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="a silent replica is dead after this")
    p.add_argument("--restart-delay-s", type=float, default=0.0, help="wait this long before restarting a group")
    p.add_argument("--dry-run", action="store_true", help="print the commands, start nothing")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every replica group (after --)")
    args = p.parse_args(argv)
    if args.nproc_per_group < 1:
        p.error(f"--nproc-per-group must be at least 1, got {args.nproc_per_group}")
    if args.group_port is None:
        args.group_port = args.port + 1
    majority_or_refuse(p, args)
    return args


def run_root(overrides: Sequence[str]) -> Path:
    roots = [o.split("=", 1)[1] for o in overrides if o.startswith("run.root=")]
    return Path(roots[-1] if roots else "runs")


def lighthouse_cmd(args: argparse.Namespace) -> List[str]:
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    return [
        exe,
        "--min_replicas",
        str(args.min_replicas),
        "--bind",
        f"127.0.0.1:{args.port}",
        "--join_timeout_ms",
        str(args.join_timeout_ms),
        "--heartbeat_timeout_ms",
        str(args.heartbeat_timeout_ms),
    ]


def group_run_dir(args: argparse.Namespace, i: int) -> Path:
    return run_root(args.overrides) / args.name / f"replica-{i}"


def rendezvous_port(args: argparse.Namespace, i: int) -> int:
    """Group ``i``'s torchrun rendezvous port: --group-port + i, or with --group-port 0 one the system has free now
    (asked again at every start, so a restarted group never inherits a port taken meanwhile)."""
    if args.group_port != 0:
        return args.group_port + i
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def replica_cmd(args: argparse.Namespace, i: int) -> List[str]:
    """Group ``i``'s command: one trainer process, or torchrun (lmforge.launch.agent) of --nproc-per-group ranks
    that does not restart on its own (this launcher restarts the whole group, which then heals)."""
    launch = ["-m", "lmforge.train"]
    if args.nproc_per_group > 1:
        launch = [
            "-m",
            "lmforge.launch.agent",
            "--nnodes=1",
            f"--nproc-per-node={args.nproc_per_group}",
            "--master-addr=127.0.0.1",
            f"--master-port={rendezvous_port(args, i)}",
            "--max-restarts=0",
            *launch,
        ]
    return [
        sys.executable,
        *launch,
        *args.overrides,
        f"run.name={args.name}/replica-{i}",
        "fault.replica_ft=torchft",
        f"fault.replica_groups={args.replicas}",
        f"fault.replica_id={i}",
        f"fault.replica_min={args.min_replicas}",
        f"fault.lighthouse=http://127.0.0.1:{args.port}",
    ]


class Job:
    """The Lighthouse and the replica groups' processes, with the record of every start and exit."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.folder = run_root(args.overrides) / args.name / "replica_ft"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.procs: Dict[int, subprocess.Popen] = {}
        self.attempts = {i: 0 for i in range(args.replicas)}
        self.final: Dict[int, int] = {}  # replica -> its last return code, once it is not restarted
        self.due: Dict[int, float] = {}  # replica -> when it is restarted (--restart-delay-s)

    def _record(self, **event) -> None:
        with open(self.folder / "launcher.jsonl", "a") as f:
            f.write(json.dumps({**event, "time": time.time()}) + "\n")

    def _spawn(self, cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        with open(log, "ab") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def start(self, i: int) -> None:
        env = {**os.environ, "LMFORGE_RUN_DIR": str(group_run_dir(self.args, i).absolute())}  # the agent's verdicts
        proc = self._spawn(replica_cmd(self.args, i), self.folder / f"replica-{i}.log", env)
        self.procs[i] = proc
        self._record(event="start", replica=i, attempt=self.attempts[i], pid=proc.pid)
        print(f"lmforge: replica group {i} started (attempt {self.attempts[i]}, pid {proc.pid})", flush=True)

    def reap(self, i: int, rc: int) -> None:
        self._record(event="exit", replica=i, attempt=self.attempts[i], rc=rc)
        del self.procs[i]
        if rc == 0 or rc == CONFIG_ERROR or self.attempts[i] >= self.args.max_restarts:
            self.final[i] = rc
            print(f"lmforge: replica group {i} exited {rc}", flush=True)
            return
        self.attempts[i] += 1
        print(f"lmforge: replica group {i} exited {rc}; restarting it (it heals from a peer)", flush=True)
        self.due[i] = time.monotonic() + self.args.restart_delay_s

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the groups are stopped below
        lighthouse = self._spawn(lighthouse_cmd(self.args), self.folder / "lighthouse.log")
        try:
            for i in range(self.args.replicas):
                self.start(i)
            while self.procs or self.due:
                for i, proc in list(self.procs.items()):
                    rc = proc.poll()
                    if rc is not None:
                        self.reap(i, rc)
                for i, when in list(self.due.items()):
                    if time.monotonic() >= when:
                        del self.due[i]
                        self.start(i)
                time.sleep(0.1)
        finally:
            for proc in self.procs.values():
                os.killpg(proc.pid, signal.SIGTERM)
            lighthouse.terminate()
            lighthouse.wait(timeout=10)
        failed = [rc for rc in self.final.values() if rc != 0]
        announce_job_goodput(self.folder.parent)  # <name>/goodput.json over the groups, and its one line
        return failed[0] if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        print(" ".join(lighthouse_cmd(args)))
        for i in range(args.replicas):
            print(" ".join(replica_cmd(args, i)))
        return 0
    return Job(args).run()


if __name__ == "__main__":
    sys.exit(main())

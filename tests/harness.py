"""Real multi-process torch.distributed runs for tests, without torchrun.

``run_ranks("module:function", world_size, args)`` starts ``world_size`` Python processes with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT set, calls
``function(**args)`` in each, and returns every rank's JSON result. A hard timeout per case kills every
rank (SIGKILL) and fails with what each rank printed; a rank's exception comes back with its traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

TESTS_DIR = Path(__file__).resolve().parent


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]
    value: Any
    error: Optional[str]
    output: str


class RanksFailed(AssertionError):
    pass


def tiny_group_args(steps: int) -> List[str]:
    """Hydra overrides of a torchft replica group as the replica-FT tests run it: one CPU process of the tiny model,
    one sequence of 2 samples a step, a train record every step on a plain console, no evaluation."""
    return [
        "model=tiny",
        f"train.max_steps={steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.eval_every=0",
        "train.threads=1",
        "train.device=cpu",
        "logging.every_steps=1",
        "logging.console=plain",
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    target: str,
    world_size: int,
    args: Optional[Dict[str, Any]] = None,
    timeout: float = 180,
    env: Optional[Dict[str, str]] = None,
    check: bool = True,
) -> List[RankResult]:
    workdir = Path(tempfile.mkdtemp(prefix="lmforge-ranks-"))
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        }
        out = open(workdir / f"rank{rank}.log", "w")
        cmd = [
            sys.executable,
            "-m",
            "harness_worker",
            target,
            json.dumps(args or {}),
            str(workdir / f"rank{rank}.json"),
        ]
        procs.append(
            (subprocess.Popen(cmd, env=rank_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), out)
        )
    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p, _ in procs):
        if time.monotonic() > deadline:
            timed_out = True
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        # One rank failing usually leaves the others blocked in a collective: stop them quickly.
        if any(p.poll() not in (None, 0) for p, _ in procs):
            grace = time.monotonic() + 20
            while any(p.poll() is None for p, _ in procs) and time.monotonic() < grace:
                time.sleep(0.1)
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    results = []
    for rank, (p, out) in enumerate(procs):
        p.wait()
        out.close()
        output = (workdir / f"rank{rank}.log").read_text(errors="replace")
        res_file = workdir / f"rank{rank}.json"
        value, error = None, None
        if res_file.exists():
            payload = json.loads(res_file.read_text())
            value, error = payload.get("value"), payload.get("error")
        results.append(RankResult(rank, p.returncode, value, error, output))
    shutil.rmtree(workdir, ignore_errors=True)  # the logs live on in RankResult.output (and in RanksFailed)
    if check and (timed_out or any(r.returncode != 0 or r.error for r in results)):
        head = f"{target} x{world_size} " + ("timed out after %.0fs" % timeout if timed_out else "failed")
        detail = "\n".join(
            f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.error or ''}\n{r.output[-4000:]}" for r in results
        )
        raise RanksFailed(f"{head}\n{detail}")
    return results

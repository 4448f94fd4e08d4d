"""Fault policies that need real processes: an orphaned worker exits, launch dry runs print what they would run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


ORPHAN_CHILD = r"""
import sys, time
from pathlib import Path
from lmforge.fault.events import FaultEvents
from lmforge.fault.watchdog import Watchdog
run = Path(sys.argv[1])
Watchdog(0, 0, run / "dumps", poll_s=0.1, orphan_check=True, on_event=FaultEvents(run / "metrics.jsonl", 0).emit).start()
print("ready", flush=True)
time.sleep(60)
"""


ORPHAN_PARENT = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
import time; time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_orphaned_worker_notices_its_dead_launcher_and_exits(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PARENT, ORPHAN_CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    child_pid = int(parent.stdout.readline())
    parent.kill()  # the "agent" dies; its worker is re-parented
    parent.wait()
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 20
    # Wait for one complete line: the file can exist for a moment before the event is written into it.
    while not (metrics.exists() and metrics.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics.exists() and metrics.read_text().strip(), "the orphaned worker wrote no event within 20 s"
    event = json.loads(metrics.read_text().splitlines()[0])
    assert event["event"] == "orphaned" and "the launcher died" in event["cause"]
    while time.monotonic() < deadline:  # gone (or a zombie waiting for its new parent to reap it)
        try:
            state = Path(f"/proc/{child_pid}/stat").read_text().split()[2]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child_pid, 9)
        pytest.fail("the orphaned worker kept running")


def _lmforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_launch_dry_runs_print_the_command_and_sbatch_script():
    local = _lmforge("launch", "--nproc", "2", "--dry-run", "model=tiny", "fault.max_restarts=5")
    assert local.returncode == 0, local.stderr
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in local.stdout
    # train.threads=0: each of the 2 workers pins this machine's CPUs / 2, exported so torchrun prints no banner
    assert f" OMP_NUM_THREADS={max(1, len(os.sched_getaffinity(0)) // 2)} " in local.stdout, local.stdout
    assert "--nproc_per_node=2" in local.stdout and "--max_restarts=5" in local.stdout
    assert local.stdout.rstrip().endswith("-m lmforge.train model=tiny fault.max_restarts=5")
    slurm = _lmforge("launch", "--slurm", "--dry-run", "--nodes", "4", "model=tiny", "cluster.signal_lead_s=300")
    assert slurm.returncode == 0, slurm.stderr
    assert "#SBATCH --requeue" in slurm.stdout and "srun" in slurm.stdout
    last = slurm.stdout.rstrip().splitlines()[-1]
    assert last.startswith("sbatch --nodes=4 ") and "--signal=B:USR1@300" in last
    assert last.endswith("slurm/train.sh model=tiny cluster.signal_lead_s=300")

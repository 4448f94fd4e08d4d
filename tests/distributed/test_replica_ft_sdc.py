"""Silent data corruption across torchft replica groups, as real processes: the launcher starts a Lighthouse and three
one-process replica groups (gloo) with fault.consistency_every=1, and the bitflip drill flips one bit of group 1's
weights right after step 3 (fault.drill.bitflip_replica=1: the other groups' rank 0 does not flip).

Asserted: at step 3 every group's fingerprint exchange through the torchft Manager names group 1, and only it; group 1
stops with the ``corrupted`` verdict (exit 47, its events ``replica_mismatch`` and ``corrupted``, which names the
group's host: the node lmforge.fault.bad_nodes has a resubmission exclude), groups 0 and 2
record the mismatch and train on to the end as two. Negative control: the same run without the drill compares the
three groups at every step and reports no mismatch; it stops at step 3 (a checkpoint) and is launched again, and the
resumed groups' torchft Managers continue the checkpointed count of committed batches (3 groups x 6 steps = 18 in
the last checkpoint; a Manager that restarted its count at the resume would hold 9).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.fault.bad_nodes import at_fault, short_host
from tests.harness import free_port, tiny_group_args

pytestmark = pytest.mark.distributed

STEPS = 6
FLIP_AT = 3
CORRUPTED = 47
ARGS = [
    *tiny_group_args(STEPS),
    "fault.consistency_every=1",
    "fault.replica_timeout_s=10",
    "fault.replica_quorum_timeout_s=60",
]
DRILL = [f"fault.drill.bitflip_step={FLIP_AT}", "fault.drill.bitflip_replica=1", "fault.drill.bitflip_rank=0"]
DRILL += ["checkpoint.enabled=false"]


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _launch(tmp_path: Path, extra: list) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lmforge.launch.replica_ft", "--replicas", "3", "--max-restarts", "0"]
    cmd += ["--name", "ft", "--port", str(free_port()), "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "10000"]
    cmd += ["--", f"run.root={tmp_path}", *ARGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def _logs(run: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted((run / "replica_ft").glob("*.log")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("drill", [True, False], ids=["bitflip-in-group-1", "control"])
def test_the_group_whose_weights_flipped_is_named_and_stops(tmp_path, drill):
    run = tmp_path / "ft"
    if not drill:  # the control stops at the flip's step and is resumed from its checkpoints
        first = _launch(tmp_path, [f"train.stop_at_step={FLIP_AT}"])
        assert first.returncode == 0, first.stdout + first.stderr + _logs(run)
    done = _launch(tmp_path, DRILL if drill else [])
    out = done.stdout + done.stderr + _logs(run)
    metrics = {i: _records(run / f"replica-{i}" / "metrics.jsonl") for i in range(3)}
    mismatches = {i: [r for r in metrics[i] if r.get("event") == "replica_mismatch"] for i in range(3)}
    train = {i: [r for r in metrics[i] if r.get("kind") == "train"] for i in range(3)}
    exits = {e["replica"]: e["rc"] for e in _records(run / "replica_ft" / "launcher.jsonl") if e["event"] == "exit"}

    if not drill:  # control: every step compared across the three groups, never a mismatch
        assert done.returncode == 0 and exits == {0: 0, 1: 0, 2: 0}, out
        assert mismatches == {0: [], 1: [], 2: []}, out
        for i in range(3):
            assert [(r["step"], r["replica_groups_compared"]) for r in train[i]] == [
                (s, 3) for s in range(1, STEPS + 1)
            ], (i, train[i])
            sidecars = [json.loads((run / f"replica-{i}" / "checkpoints" / f"step-{s:08d}" / "state.json").read_text())
                        for s in (FLIP_AT, STEPS)]  # fmt: skip
            assert [c["replica_ft"] for c in sidecars] == [
                {"step": FLIP_AT, "batches_committed": 3 * FLIP_AT},
                {"step": STEPS, "batches_committed": 3 * STEPS},
            ], (i, sidecars)
        assert "holds no torchft Manager state" not in out
        return

    assert done.returncode == CORRUPTED and exits == {0: 0, 1: CORRUPTED, 2: 0}, out
    for i in range(3):  # every group names group 1, and only it, at the flip's step
        (found,) = mismatches[i]
        assert (found["step"], found["replica_groups"], found["participants"]) == (FLIP_AT, [1], [0, 1, 2]), found
        assert found["this_group_suspect"] == (i == 1) and found["tensors"], found
    (corrupted,) = [r for r in metrics[1] if r.get("event") == "corrupted"]
    assert corrupted["step"] == FLIP_AT and corrupted["replica_groups"] == [1] and corrupted["last_good_step"] == 2
    assert "replica group 1's state differs from groups [0, 2]" in corrupted["cause"]
    assert corrupted["hosts"] == [socket.gethostname()], corrupted  # the group's one rank runs here
    host = short_host(socket.gethostname())
    reason = f"silent data corruption on its replica group's state at step {FLIP_AT} (fault.consistency_every)"
    assert at_fault(run / "replica-1", [host], {}, straggler_limit=0) == {host: reason}
    assert at_fault(run / "replica-0", [host], {}, straggler_limit=0) == {}  # a healthy group names nobody
    (verdict,) = [json.loads(p.read_text()) for p in (run / "replica-1" / "verdicts").glob("rank*.json")]
    assert (verdict["kind"], verdict["exit_code"], verdict["step"]) == ("corrupted", CORRUPTED, FLIP_AT), verdict
    assert [r["step"] for r in train[1]] == list(range(1, FLIP_AT)), train[1]  # stopped before logging step 3
    for i in (0, 2):  # the healthy groups train on: compared as three up to the flip, as two after it
        assert not [r for r in metrics[i] if r.get("event") == "corrupted"]
        compared = [(r["step"], r["replica_groups_compared"]) for r in train[i]]
        assert compared[: FLIP_AT - 1] == [(1, 3), (2, 3)] and compared[-1] == (STEPS, 2), (i, compared)

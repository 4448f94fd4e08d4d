"""Replica-level fault tolerance with torchft (fault.replica_ft=torchft), as real processes: the launcher starts a
torchft Lighthouse and three replica groups (one ``python -m lmforge.train`` each, gloo); the test SIGKILLs
replica group 1 at step 3; the launcher restarts it 4 s later (the two others train on meanwhile) and it heals from
a healthy peer.

Asserted: groups 0 and 2 are started once and exit 0 (they never stop), every step of theirs is trained once;
the membership records show [0, 1, 2], then [0, 2] after the kill, then [0, 1, 2] again with group 1 healed, at a
step where the three groups' SHA-256 of weights and optimizer state are identical; periodic checkpoints are
written by every group, with their torchft Manager's state (step, batches committed); the check across groups
(fault.consistency_every=4) never finds a mismatch, at the healed group's steps too. Negative control: the restarted group's own state before healing (the seed's
initialisation) differs from its peers' at that step: without the recovery it would train on different weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.harness import free_port, tiny_group_args

STEPS = 40
KILL_AT = 3
ARGS = [
    *tiny_group_args(STEPS),
    "checkpoint.every_steps=8",
    "fault.drill.step_sleep_s=1.0",  # leaves the restarted group time to start while its peers train on
    "fault.replica_timeout_s=3",
    "fault.replica_quorum_timeout_s=60",
    "fault.consistency_every=4",  # the groups' fingerprints compared through torchft (fault/group_check.py)
]


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_all_three(membership: Path, step: int, launcher: subprocess.Popen, deadline: float) -> None:
    """Until replica group 1 has committed a step >= ``step`` with all three groups participating."""
    while time.time() < deadline:
        assert launcher.poll() is None, "the launcher ended before the kill"
        records = _records(membership)
        if any(r["replicas"] == [0, 1, 2] for r in records) and records[-1]["step"] >= 1:
            metrics = _records(membership.parents[1] / "metrics.jsonl")
            if any(r.get("kind") == "train" and r["step"] >= step for r in metrics):
                return
        time.sleep(0.1)
    raise AssertionError(f"replica group 1 did not train step {step} with its two peers in time")


def _members_at(committed: list, step: int) -> list:
    """The participating groups of a committed ``step``: those of the last committed membership record at or before it
    (a record is written at every change of membership)."""
    return [r for r in committed if r["step"] <= step][-1]["replicas"]


def test_a_killed_replica_group_rejoins_with_its_peers_state(tmp_path):
    run = tmp_path / "ft"
    cmd = [
        sys.executable,
        "-m",
        "lmforge.launch.replica_ft",
        "--replicas",
        "3",
        "--max-restarts",
        "1",
        "--restart-delay-s",
        "4",
    ]
    cmd += ["--name", "ft", "--port", str(free_port()), "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "10000"]
    cmd += ["--", f"run.root={tmp_path}", *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_all_three(run / "replica-1" / "replica_ft" / "membership.jsonl", KILL_AT, launcher, time.time() + 120)
        events = _records(run / "replica_ft" / "launcher.jsonl")
        victim = next(e["pid"] for e in events if e["event"] == "start" and e["replica"] == 1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        out, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:  # the launcher stops its groups and the Lighthouse on SIGTERM
            launcher.terminate()
            launcher.communicate(timeout=60)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "replica_ft").glob("*.log")))
    assert launcher.returncode == 0, out + logs

    # the launcher's record: group 1 killed (-9) and restarted once; groups 0 and 2 never exited before the end
    events = _records(run / "replica_ft" / "launcher.jsonl")
    starts = {i: [e for e in events if e["event"] == "start" and e["replica"] == i] for i in range(3)}
    exits = {i: [e["rc"] for e in events if e["event"] == "exit" and e["replica"] == i] for i in range(3)}
    assert [len(starts[i]) for i in range(3)] == [1, 2, 1], events
    assert exits == {0: [0], 1: [-signal.SIGKILL, 0], 2: [0]}, events

    # the groups that stayed trained every step from the kill on once (a step no group committed is redone, not
    # logged twice; a group that joined the first quorum late took its peers' step then) and checkpointed
    for i in (0, 2):
        steps = [r["step"] for r in _records(run / f"replica-{i}" / "metrics.jsonl") if r.get("kind") == "train"]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS, (i, steps)
        assert set(range(KILL_AT, STEPS + 1)) <= set(steps), (i, steps)
        assert {"step-00000032", "step-00000040"} <= {p.name for p in (run / f"replica-{i}" / "checkpoints").iterdir()}

    members = {i: _records(run / f"replica-{i}" / "replica_ft" / "membership.jsonl") for i in range(3)}
    committed = {i: [r for r in members[i] if r.get("committed", True)] for i in range(3)}
    shrunk = [r for r in committed[0] if r["replicas"] == [0, 2] and r["step"] > KILL_AT]  # not a start-up quorum
    assert shrunk, committed[0]
    rejoin = next(r for r in committed[1] if r["healed"] and r["step"] > shrunk[0]["step"])
    assert rejoin["replicas"] == [0, 1, 2], committed[1]
    peers = [next(r for r in committed[i] if r["step"] == rejoin["step"]) for i in (0, 2)]
    assert [p["replicas"] for p in peers] == [[0, 1, 2]] * 2
    # bit-identical: weights and AdamW moments of the healed group equal its peers' at its first committed step
    assert rejoin["state_sha256"] == peers[0]["state_sha256"] == peers[1]["state_sha256"], (rejoin, peers)
    # negative control: what the restarted group held before healing is not its peers' state
    assert rejoin["state_sha256_before_heal"] != rejoin["state_sha256"]

    # the check across groups found nothing, through the kill and the heal; each checkpoint holds its torchft Manager's
    # state: its step and the batches committed, one per participating group of each step between the last two
    # checkpoints (the membership in effect at a step: the last committed membership record at or before it)
    for i in range(3):
        metrics = _records(run / f"replica-{i}" / "metrics.jsonl")
        assert not [r for r in metrics if r.get("event") in ("replica_mismatch", "corrupted")], i
    compared = [r for r in _records(run / "replica-0" / "metrics.jsonl") if r.get("replica_groups_compared") == 3]
    assert any(r["step"] >= rejoin["step"] for r in compared), compared
    for i in (0, 2):
        state = [
            json.loads((run / f"replica-{i}" / "checkpoints" / f"step-{s:08d}" / "state.json").read_text())[
                "replica_ft"
            ]
            for s in (32, 40)
        ]
        expected = sum(len(_members_at(committed[i], step)) for step in range(33, 41))
        assert [m["step"] for m in state] == [32, 40], state
        assert state[1]["batches_committed"] - state[0]["batches_committed"] == expected, (state, expected)
        assert 2 * 32 <= state[0]["batches_committed"] <= 3 * 32, state

    # the figures docs/fault-tolerance.md reports: kill to the rejoined commit, and the steps trained by two
    rejoined_s = rejoin["time"] - killed_at
    restarted_s = starts[1][1]["time"] - killed_at
    redone = [r["step"] for r in members[0] if not r.get("committed", True)]
    print(
        f"replica_ft: kill -> restart {restarted_s:.1f} s -> rejoin {rejoined_s:.1f} s; steps redone {redone}; steps "
        f"{shrunk[0]['step']}..{rejoin['step'] - 1} on 2 groups"
    )

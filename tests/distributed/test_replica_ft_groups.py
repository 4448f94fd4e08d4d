"""Replica groups of several ranks under torchft (fault.replica_ft=torchft, launchers/torchft_local.sh
--nproc-per-group 2): 2 replica groups x 2 ranks (gloo), a torchft Lighthouse, each group one torchrun launch, in
two layouts: FSDP (parallelism=fsdp, dp_shard=2) and tensor + sequence parallelism (parallelism=tp2_sp: column- and
row-sharded weights, replicated norms, the loss on vocab-sharded logits). The test SIGKILLs rank 1 of group 1 once
step 3 is logged; its torchrun exits, the launcher restarts the group, and each of its ranks heals from the same rank
of group 0 (with 2 groups a majority is both: group 0 waits for it, so every committed step has both groups).

Asserted: (a) parity: every step's loss of both groups, before the kill and after the heal, equals that of one job
with the same global batch of 2 x 4 samples (FSDP: 4 ranks, dp_shard=4; tp2_sp: 2 ranks of tp2_sp accumulating the 2
groups' micro batches), within the parity harness's tolerance for these layouts (1e-5); negative control: the loss of
one group's own 4 samples (no cross-replica averaging; the reference's layout with a global batch of 4), at steps 1
and 2, is farther from the reference than 100x that tolerance. (b) healing: group 1 is started twice and group 0 once,
both exit 0; at group 1's first committed step after the kill, its two ranks' digests of weights and AdamW moments
(their local FSDP or TP shards) equal group 0's rank for rank, and group 0 records that step with group 1 healed;
negative control: group 1's ranks' own states before healing differ from those digests. (c) the replica check across
groups (fault.consistency_every=1, fault/group_check.py) compares the two groups rank for rank at every step both
logged, the healed group's first step back included, and never finds a mismatch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port, run_ranks

pytestmark = pytest.mark.distributed

STEPS, KILL_AT = 8, 3
TOL = 1e-5  # the parity harness's for DP and TP layouts (tests/distributed/test_parallel_parity.py)
COMMON = [
    "model=tiny",
    "model.seq_len=32",
    "comm=cpu_gloo",
    "train.device=cpu",
    "train.threads=1",
    f"train.max_steps={STEPS}",
    "train.eval_every=0",
    "logging.every_steps=1",
    "metrics.straggler_every=0",
    "checkpoint.enabled=false",
    "~data.sources.code",
    "~data.sources.reference",
]


# layout: (a group's overrides (2 ranks, global batch 4), the reference's ranks, its overrides (global batch 8), and
# the negative control's (global batch 4: group 0's samples alone)). tp2_sp's reference is one tp2_sp copy
# accumulating the 2 groups' micro batches of 4: the same mean over the same 8 samples as 2 dp ranks x tp2
# (parallelism=tp2_dp2, 4 ranks: its losses were bit-identical) at half the ranks.
LAYOUTS = {
    "fsdp": (
        ["parallelism=fsdp", "train.micro_batch_size=2"],
        4,
        ["parallelism=fsdp", "parallelism.dp_shard=4", "train.micro_batch_size=2"],
        ["parallelism=fsdp", "parallelism.dp_shard=4", "train.micro_batch_size=1"],
    ),
    "tp2_sp": (
        ["parallelism=tp2_sp", "train.micro_batch_size=4"],
        2,
        ["parallelism=tp2_sp", "train.micro_batch_size=4"],
        ["parallelism=tp2_sp", "train.micro_batch_size=4"],
    ),
}


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _losses(run_dir: Path) -> list:
    """(step, loss) of every train record (a step logged twice is checked against the reference twice)."""
    return [(r["step"], r["loss"]) for r in _records(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def _logs(run: Path) -> str:
    """The tail of the Lighthouse's and each group's log (every attempt), for a failure's message."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted((run / "replica_ft").glob("*.log")))


def _rank_pid(agent_pid: int, rank: int) -> int:
    """The pid of the worker with RANK=rank among torchrun's children."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} among torchrun {agent_pid}'s children {children}")


def _reference(tmp_path: Path, layout: str) -> tuple:
    """One job of the global batch of both groups, and (negative control) of group 0's 4 samples."""
    _, ranks, whole_layout, own_layout = LAYOUTS[layout]
    four = [*COMMON, "logging.console=none", f"run.root={tmp_path}"]
    whole = [*four, *whole_layout, "train.global_batch_size=8", "run.name=ref"]
    # the control's first two steps: before and after one update from group 0's own gradients
    own = [a for a in four if not a.startswith("train.max_steps=")] + ["train.max_steps=2"]
    own += [*own_layout, "train.global_batch_size=4", "run.name=own"]
    run_ranks(
        "distributed.train_entries:train_entries",
        ranks,
        {"argvs": [whole, own]},
        timeout=240,
        env={"OMP_NUM_THREADS": "1"},
    )
    return dict(_losses(tmp_path / "ref")), dict(_losses(tmp_path / "own"))


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replica_groups_match_one_job_and_a_killed_rank_heals_from_its_peer_rank(tmp_path, data_cache, layout):
    ref, own = _reference(tmp_path, layout)
    assert sorted(ref) == list(range(1, STEPS + 1)) and ref[STEPS] < ref[1], ref

    run = tmp_path / "ft"
    cmd = [sys.executable, "-m", "lmforge.launch.replica_ft", "--replicas", "2", "--nproc-per-group", "2"]
    cmd += ["--max-restarts", "1", "--name", "ft", "--port", str(free_port()), "--group-port", "0"]
    cmd += ["--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "10000", "--", f"run.root={tmp_path}", *COMMON]
    cmd += LAYOUTS[layout][0]
    cmd += ["train.global_batch_size=4", "logging.console=plain", "fault.drill.step_sleep_s=0.5"]
    cmd += ["fault.replica_timeout_s=5", "fault.replica_quorum_timeout_s=120", "fault.consistency_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 150
        while not any(s >= KILL_AT for s, _ in _losses(run / "replica-1")):
            if launcher.poll() is not None or time.time() > deadline:
                launcher.terminate()
                out, _ = launcher.communicate(timeout=60)
                raise AssertionError(f"group 1 did not reach the kill step\n{out}{_logs(run)}")
            time.sleep(0.1)
        agent = next(e["pid"] for e in _records(run / "replica_ft" / "launcher.jsonl") if e["replica"] == 1)
        os.kill(_rank_pid(agent, 1), signal.SIGKILL)
        killed_at = time.time()
        out, _ = launcher.communicate(timeout=200)
    finally:
        if launcher.poll() is None:  # the launcher stops its groups and the Lighthouse on SIGTERM
            launcher.terminate()
            launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out + _logs(run)

    events = _records(run / "replica_ft" / "launcher.jsonl")
    starts = [sum(e["event"] == "start" and e["replica"] == i for e in events) for i in (0, 1)]
    exits = {i: [e["rc"] for e in events if e["event"] == "exit" and e["replica"] == i] for i in (0, 1)}
    assert starts == [1, 2] and exits[0] == [0] and exits[1][-1] == 0 and exits[1][0] != 0, events

    members = {i: _records(run / f"replica-{i}" / "replica_ft" / "membership.jsonl") for i in (0, 1)}
    rejoin = next(r for r in members[1] if r.get("healed") and r["step"] > KILL_AT)  # group 1's first step back

    # (a) parity: every step of both groups, around the kill too, is the reference job's step (group 1 logs the steps
    # before the kill and from its first step back; the step it died in may have been committed by its peer)
    gaps = []
    for i, expected in ((0, range(1, STEPS + 1)), (1, [*range(1, KILL_AT + 1), *range(rejoin["step"], STEPS + 1)])):
        losses = _losses(run / f"replica-{i}")
        assert {s for s, _ in losses} >= set(expected), (i, losses)
        for step, loss in losses:
            assert abs(loss - ref[step]) < TOL, (i, step, loss, ref[step])
            gaps.append(abs(loss - ref[step]))
    # negative control: one group's samples alone, before and after one update from its own gradients
    assert all(abs(own[s] - ref[s]) > 100 * TOL for s in (1, 2)), (own, ref)

    # (b) healing: group 1's ranks took group 0's ranks' shards, rank for rank
    peer = next(r for r in members[0] if r.get("committed", True) and r["step"] == rejoin["step"])
    assert rejoin["replicas"] == peer["replicas"] == [0, 1] and peer["healed_replicas"] == [1], (rejoin, peer)
    assert len(rejoin["state_sha256_ranks"]) == 2
    assert rejoin["state_sha256_ranks"] == peer["state_sha256_ranks"], (rejoin, peer)
    assert rejoin["state_sha256"] == peer["state_sha256"]
    # negative control: what group 1's ranks held before healing (their initialisation) is not their peers' state
    before = rejoin["state_sha256_before_heal_ranks"]
    assert all(b != a for b, a in zip(before, peer["state_sha256_ranks"])), (before, peer)
    # (c) the check across groups (fault.consistency_every=1): rank i of each group compared with rank i of the other
    # at every step both groups logged; never a mismatch, the healed group's first step back included
    metrics = {i: _records(run / f"replica-{i}" / "metrics.jsonl") for i in (0, 1)}
    assert not [r for i in (0, 1) for r in metrics[i] if r.get("event") in ("replica_mismatch", "corrupted")]
    compared = {
        i: {r["step"]: r.get("replica_groups_compared") for r in metrics[i] if r.get("kind") == "train"} for i in (0, 1)
    }
    assert compared[1][rejoin["step"]] == 2 and compared[0][STEPS] == 2, compared
    assert sum(v == 2 for v in compared[0].values()) >= STEPS - 1, compared  # the kill's step may compare nothing
    redone = [r["step"] for r in members[0] if not r.get("committed", True)]
    restarted = next(e["time"] for e in events if e["event"] == "start" and e["replica"] == 1 and e["attempt"] == 1)
    print(
        f"replica_ft groups: 2 x 2 ranks {layout}; max |loss - one job| {max(gaps):.1e} (group alone "
        f"{abs(own[1] - ref[1]):.1e}); kill -> group restarted {restarted - killed_at:.1f} s -> rejoined at step "
        f"{rejoin['step']} {rejoin['time'] - killed_at:.1f} s; steps redone {redone}"
    )

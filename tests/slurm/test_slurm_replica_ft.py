"""A torchft run on the real Slurm cluster (cluster.py), supervised by ``lmforge.launch.replica_ft_slurm``.

The Lighthouse is a job on node1 (``--lighthouse-node``); two replica groups (``--replicas 2``: the majority is 2,
so ``replica_min=2``) are one exclusive 1-node slurm/train.sh job each, never on node1; the fourth node is the spare.
When both groups have committed a step together, the node of group 1 is killed (slurmd and every process on it). The
supervisor sees the job end NODE_FAIL, excludes that node (Slurm reports it down) and resubmits group 1, which runs
on the spare node, heals from group 0 (which waited in its quorum, never restarted) and both train to the end.

Asserted: the supervisor exits 0 and its record holds the two submissions of group 1 (the second with
``--exclude=node1,<killed node>``), the NODE_FAIL end, the exclusion with its reason, and the new job's node (the
spare); Slurm's record of the new job shows the same ExcNodeList and NodeList; group 0 was submitted once. In the
membership records group 1's first commit after the kill is healed, at a step of both groups; group 0 never
committed a step alone (the step it was in is redone); the final weights of both groups are bit-identical; the
negative control: group 1's state before healing differs from the state it healed to; the supervisor writes the
job's goodput.json over both groups. A minority --min-replicas
and too few nodes are refused before anything is submitted (exit 2, one line); a group exiting 2 is given up, not
resubmitted; SIGTERM, and the end of the Lighthouse's job, cancel every job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.checkpoint.weights import load_full_model_state
from tests.harness import tiny_group_args

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

STEPS = 12
KILL_AT = 3
ARGS = [
    *tiny_group_args(STEPS),
    "parallelism=single",
    "checkpoint.every_steps=12",  # the final state of each group, compared below
    "cluster.gpus_per_node=1",
    "fault.drill.step_sleep_s=1.0",  # a window to kill group 1's node while both groups train
    "fault.replica_timeout_s=10",
    "fault.replica_quorum_timeout_s=240",  # group 0 waits this long for the resubmitted group (majority of 2 is 2)
]


def supervisor_cmd(cluster, root: Path, *extra: str):
    return [
        "nsenter",
        f"--net=/run/netns/{cluster.ns[cluster.nodes[0]]}",
        sys.executable,
        "-m",
        "lmforge.launch.replica_ft_slurm",
        *extra,
        "--",
        f"run.root={root}/runs",
        *ARGS,
    ]


def records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_both_trained(run: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Until group 1 has committed a step >= KILL_AT with group 0."""
    deadline = time.monotonic() + timeout
    membership = run / "replica-1" / "replica_ft" / "membership.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the supervisor ended before the kill"
        done = [r for r in records(membership) if r.get("committed", True) and r["replicas"] == [0, 1]]
        metrics = run / "replica-1" / "metrics.jsonl"
        steps = [r["step"] for r in records(metrics) if r.get("kind") == "train"] if done else []
        if steps and max(steps) >= KILL_AT:
            return
        time.sleep(0.2)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((run / "replica_ft").glob("*.*")))
    raise AssertionError(f"the two groups did not train step {KILL_AT} together in {timeout}s\n{logs}")


def test_bad_input_is_refused_before_submitting(slurm_cluster, job_env, tmp_path):
    env = {**slurm_cluster.env, **job_env}
    minority = subprocess.run(
        supervisor_cmd(slurm_cluster, tmp_path, "--replicas", "2", "--min-replicas", "1", "--name", "m"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert minority.returncode == 2 and "--min-replicas 1 is not a majority of --replicas 2" in minority.stderr
    assert len(minority.stderr.strip().splitlines()) == 1, minority.stderr
    too_many = subprocess.run(
        supervisor_cmd(slurm_cluster, tmp_path, "--replicas", "4", "--name", "n"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert too_many.returncode == 2, too_many.stderr
    assert "plus the Lighthouse's node need 5 nodes; Slurm has 4 usable" in too_many.stderr, too_many.stderr
    assert len(too_many.stderr.strip().splitlines()) == 1 and "Traceback" not in too_many.stderr
    assert not (tmp_path / "runs").exists()  # nothing was submitted


@pytest.mark.timeout(600)
def test_a_group_on_a_failed_node_is_resubmitted_elsewhere_and_heals(slurm_cluster, job_env, tmp_path):
    slurm_cluster.wait_idle(4, timeout=300)  # after the other modules' jobs
    run = tmp_path / "runs" / "ft"
    extra = ["--replicas", "2", "--name", "ft", "--lighthouse-node", "node1", "--sbatch-arg=--exclusive"]
    extra += ["--max-resubmits", "1", "--poll-s", "0.5", "--heartbeat-timeout-ms", "2000"]
    extra += ["--join-timeout-ms", "10000", "--port", "29517"]
    proc = subprocess.Popen(
        supervisor_cmd(slurm_cluster, tmp_path, *extra),
        cwd=tmp_path,
        env={**slurm_cluster.env, **job_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    victim = ""
    try:
        wait_both_trained(run, proc, timeout=240)
        log = records(run / "replica_ft" / "supervisor.jsonl")
        first = {e["replica"]: e for e in log if e["event"] == "start" and e["role"] == "group"}
        victim = first[1]["nodes"][0]
        assert victim != first[0]["nodes"][0] and "node1" not in (victim, first[0]["nodes"][0]), first
        killed_at = time.time()
        assert slurm_cluster.kill_node(victim), f"nothing ran on {victim}"
        out, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:  # SIGTERM: the supervisor cancels every job
            proc.terminate()
            proc.communicate(timeout=60)
        if victim:
            slurm_cluster.start_slurmd(victim)  # the node returns for the other modules
    assert proc.returncode == 0, out

    log = records(run / "replica_ft" / "supervisor.jsonl")
    spare = ({"node2", "node3", "node4"} - {victim, first[0]["nodes"][0]}).pop()
    subs = {i: [e for e in log if e["event"] == "submit" and e.get("replica") == i] for i in (0, 1)}
    assert [len(subs[0]), len(subs[1])] == [1, 2], log
    assert subs[0][0]["exclude"] == subs[1][0]["exclude"] == ["node1"], log  # the Lighthouse's node: no group
    assert subs[1][1]["exclude"] == sorted(["node1", victim]), log
    old, new = subs[1][0]["job"], subs[1][1]["job"]
    end = next(e for e in log if e["event"] == "end" and e["job"] == old)
    assert (end["state"], end["nodes"]) == ("NODE_FAIL", [victim]), end
    excluded = [e for e in log if e["event"] == "exclude"]
    assert [(e["node"], e["job"]) for e in excluded] == [(victim, old)], excluded
    assert excluded[0]["reason"].startswith(f"job {old} ended NODE_FAIL; Slurm reports {victim} down"), excluded
    started = next(e for e in log if e["event"] == "start" and e["job"] == new)
    assert started["nodes"] == [spare], started
    assert [e["rc"] for e in log if e["event"] == "exit"] == [0], log
    info = slurm_cluster.job_info(new)  # Slurm's own record of the resubmitted job
    exc = slurm_cluster.client(["scontrol", "show", "hostnames", info["ExcNodeList"]]).stdout.split()
    assert (exc, info["NodeList"], info["JobState"]) == (["node1", victim], spare, "COMPLETED"), info

    members = {i: [r for r in records(run / f"replica-{i}" / "replica_ft" / "membership.jsonl")] for i in (0, 1)}
    committed = {i: [r for r in members[i] if r.get("committed", True)] for i in (0, 1)}
    rejoin = next(r for r in committed[1] if r["healed"] and r["time"] > killed_at)
    assert rejoin["replicas"] == [0, 1] and rejoin["step"] > KILL_AT, committed[1]
    # group 0 never committed without group 1 (the majority of 2 is 2): every step it committed was with group 1 (a
    # step it was in at the kill, if any, was redone: "committed": false with itself alone)
    assert committed[0] and all(r["replicas"] == [0, 1] for r in committed[0]), members
    assert all(r["replicas"] == [0] for r in members[0] if not r.get("committed", True)), members
    peer = [r for r in committed[0] if r["step"] == rejoin["step"]]  # recorded where the peer notes the heal
    assert all(r["state_sha256"] == rejoin["state_sha256"] for r in peer), (peer, rejoin)
    # the state group 1 had before healing is not what it heals to (negative control: without the recovery it would
    # train on other weights); the two groups' final weights are bit-identical
    assert rejoin["state_sha256_before_heal"] != rejoin["state_sha256"], rejoin
    final = [load_full_model_state(run / f"replica-{i}" / "checkpoints" / f"step-{STEPS:08d}")[1] for i in (0, 1)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    for i in (0, 1):
        steps = [r["step"] for r in records(run / f"replica-{i}" / "metrics.jsonl") if r.get("kind") == "train"]
        assert steps[-1] == STEPS, (i, steps)

    # the supervisor's last act: the job's goodput over both groups (group 1 in two launches, the first one killed)
    report = json.loads((run / "goodput.json").read_text())
    assert report["replica_groups"] == 2 and [g["launches"] for g in report["groups"]] == [1, 2], report
    assert 0 < report["goodput"] < 1 and sum(report["seconds"].values()) == pytest.approx(report["replica_seconds"])
    assert f"lmforge: job goodput {report['goodput']:.1%} over 2 replica groups" in out, out
    t = {e["event"] + str(e.get("job")): e["time"] for e in log}
    print(
        f"replica_ft on Slurm: kill -> NODE_FAIL seen {t['end' + old] - killed_at:.1f} s -> resubmitted "
        f"{t['submit' + new] - killed_at:.1f} s -> running on {spare} {t['start' + new] - killed_at:.1f} s -> "
        f"healed commit {rejoin['time'] - killed_at:.1f} s (step {rejoin['step']})"
    )
    slurm_cluster.wait_idle(4, timeout=120)


def wait_record(path: Path, proc: subprocess.Popen, pred, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = records(path)
        if pred(log):
            return log
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no such record in {path} within {timeout}s: {records(path)}")


@pytest.mark.timeout(300)
def test_a_config_error_is_given_up_sigterm_and_a_lost_lighthouse_cancel_all(slurm_cluster, job_env, tmp_path):
    env = {**slurm_cluster.env, **job_env}
    # A group whose job exits 2 (its prepare step refuses the batch arithmetic) is given up, not resubmitted.
    bad = subprocess.run(
        [*supervisor_cmd(slurm_cluster, tmp_path, "--replicas", "1", "--name", "bad", "--poll-s", "0.5")]
        + ["train.global_batch_size=3"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    log = records(tmp_path / "runs" / "bad" / "replica_ft" / "supervisor.jsonl")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert [e["replica"] for e in log if e["event"] == "submit" and e["role"] == "group"] == [0], log
    end = next(e for e in log if e["event"] == "end")
    assert (end["state"], end["rc"]) == ("FAILED", 2), end
    assert next(e for e in log if e["event"] == "give_up")["reason"].startswith("exit 2 is a config error"), log
    lighthouse = next(e["job"] for e in log if e["role"] == "lighthouse")
    slurm_cluster.wait_state(lighthouse, {"CANCELLED"}, timeout=60, fail_states=("COMPLETED", "FAILED"))

    # SIGTERM: the supervisor cancels the Lighthouse and every group and exits 143.
    proc = subprocess.Popen(
        supervisor_cmd(slurm_cluster, tmp_path, "--replicas", "1", "--name", "term", "--poll-s", "0.5"),
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        path = tmp_path / "runs" / "term" / "replica_ft" / "supervisor.jsonl"
        log = wait_record(path, proc, lambda log: any(e.get("role") == "group" for e in log), timeout=120)
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, out
    jobs = [e["job"] for e in log if e["event"] == "submit"]
    exit_ = records(path)[-1]
    assert (exit_["event"], exit_["reason"], exit_["cancelled"]) == ("exit", "SIGTERM", jobs[1:]), exit_
    for job in jobs:
        slurm_cluster.wait_state(job, {"CANCELLED"}, timeout=60, fail_states=("COMPLETED", "FAILED"))

    # The Lighthouse's job ends (cancelled here, a dead node in production): no quorum can form, so every group's job
    # is cancelled and the supervisor exits 1 saying why.
    proc = subprocess.Popen(
        supervisor_cmd(slurm_cluster, tmp_path, "--replicas", "1", "--name", "lost", "--poll-s", "0.5"),
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        path = tmp_path / "runs" / "lost" / "replica_ft" / "supervisor.jsonl"
        log = wait_record(path, proc, lambda log: any(e.get("role") == "group" for e in log), timeout=120)
        lighthouse, group = [e["job"] for e in log if e["event"] == "submit"]
        slurm_cluster.client(["scancel", lighthouse])
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and f"the Lighthouse's job {lighthouse} ended CANCELLED" in out, out
    assert records(path)[-1]["cancelled"] == [group], records(path)
    slurm_cluster.wait_state(group, {"CANCELLED"}, timeout=60, fail_states=("COMPLETED", "FAILED"))

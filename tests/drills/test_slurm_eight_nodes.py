"""An 8-node Slurm job that loses a node, on the Slurm test cluster (tests/slurm/cluster.py: real slurmctld and
slurmd daemons, one network namespace a node; 10 nodes, so the requeued job finds 8 without the failed one even
when Slurm drains a second node while it ends the first run: the batch host's step can take longer than
``UnkillableStepTimeout`` (60 s) to end on a loaded machine, and Slurm then drains that node with "Kill task
failed", as it would on a real cluster).

``sbatch --nodes=8 slurm/train.sh``: one torchrun agent and one rank a node, ``model=tiny``, HSDP with each
replica sharded over 2 nodes (``dp_shard=2`` x ``dp_replicate=4``), a checkpoint every 4 of 12 steps. Once the
step-4 checkpoint is committed, one node's slurmd, slurmstepd and workers are SIGKILLed (``kill_node``). The job
must requeue onto 8 other nodes, resume from a committed checkpoint, complete, and log losses bit-identical to the
same config trained uninterrupted by a local 8-process launch. The drill prints a summary: the node killed and the
step it was killed at, the requeue, the resume step and the final step.

The same 8 nodes under torchft (``fault.replica_ft=torchft``, on the same cluster, after the nodes the first drill
took out of service are restored): ``lmforge.launch.replica_ft_slurm --replicas 4 --nodes-per-group 2`` with the
Lighthouse on node1 and each replica group one exclusive 2-node ``slurm/train.sh`` job (FSDP ``dp_shard=2``, one
rank a node; ``replica_min`` 3, a majority of 4), node10 spare. Once group 2 has committed step 3 with the others,
its head node is killed. Asserted: the group's job ends NODE_FAIL; the supervisor excludes the node (its record and
Slurm's ExcNodeList) and resubmits the group, which runs elsewhere; the other groups are submitted once and commit
without it; the resubmitted group heals from a peer, rank for rank, at a step the others record with the same
digests (negative control: its state before healing differs); every committed step's data position equals a
replay of the recorded membership history (negative control: a replay of four groups throughout does not match);
the steps of four groups from step 1 until the kill equal the HSDP run's losses within the DP layouts' tolerance
(negative control: the last step, after the shrink, does not); the four groups' final weights are bit-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path.insert(0, str(TESTS / "slurm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import SlurmCluster, unavailable_reason  # noqa: E402
from test_doc_commands_slurm import cpu_counting_python, job_cpu_s  # noqa: E402

from lmforge.checkpoint.weights import load_full_model_state  # noqa: E402

JOB_NODES, CLUSTER_NODES, STEPS, EVERY = 8, 10, 12, 4
OVERRIDES = [
    "model=tiny",
    "parallelism=hsdp",
    "parallelism.dp_replicate=4",
    "parallelism.dp_shard=2",  # a replica's parameters sharded over 2 nodes (one rank a node)
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=1",
    "train.global_batch_size=8",
    "train.threads=1",
    "train.device=cpu",
    "train.eval_every=0",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep_last=5",
    "logging.every_steps=1",
    "logging.console=plain",
    "logging.wandb.mode=disabled",
    "cluster.gpus_per_node=1",
]


def train_losses(run_dir: Path) -> Dict[int, float]:
    """step -> loss; a step logged twice (trained again after the requeue) keeps its last value."""
    out: Dict[int, float] = {}
    for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if rec.get("kind") == "train":
            out[int(rec["step"])] = rec["loss"]
    return out


def events(run_dir: Path, name: str) -> list:
    recs = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in recs if r.get("kind") == "event" and r.get("event") == name]


def job_env(data_cache: Path, tmp: Path) -> Dict[str, str]:
    return {
        "LMFORGE_REPO": str(REPO),
        "LMFORGE_PYTHON": str(cpu_counting_python(tmp / "python-cpu", tmp / "cpu.log")),
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "LMFORGE_DATA_CACHE": str(data_cache),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache) -> Dict[int, float]:
    """The same config, uninterrupted: a local 8-process launch (``lmforge launch --nproc 8``)."""
    root = tmp_path_factory.mktemp("eight-ref")
    cmd = [sys.executable, "-m", "lmforge.cli", "launch", "--nproc", str(JOB_NODES), *OVERRIDES]
    cmd += [f"run.root={root}", "run.name=ref"]
    env = {**os.environ, **job_env(data_cache, root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"reference failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    losses = train_losses(root / "ref")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, reference):  # after the reference: the two never share the cores
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    c = SlurmCluster.start(tmp_path_factory.mktemp("slurm10"), nodes=CLUSTER_NODES)
    try:
        yield c
    finally:
        c.stop()


def job_log(root: Path, job: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(root.glob(f"job-{job}.*")))


def wait_for(path: Path, timeout: float, root: Path, job: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s\n{job_log(root, job)[-4000:]}")
        time.sleep(0.2)


def wait_requeued_and_completed(cluster, job: str, root: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = cluster.wait_state(job, {"COMPLETED"}, timeout=max(1.0, deadline - time.monotonic()))
        except AssertionError as e:
            raise AssertionError(f"{e}\n{job_log(root, job)[-6000:]}") from None
        if int(info.get("Restarts", "0")) >= 1 or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


@pytest.mark.timeout(1800)
def test_eight_node_job_loses_a_node_requeues_resumes_and_matches_the_uninterrupted_run(
    cluster, reference, tmp_path, data_cache
):
    env = job_env(data_cache, tmp_path)
    args = [f"--nodes={JOB_NODES}", "--job-name=eight", "-o", f"{tmp_path}/job-%j.out", "-e", f"{tmp_path}/job-%j.err"]
    args += [str(REPO / "slurm" / "train.sh"), *OVERRIDES, f"run.root={tmp_path}/runs", "fault.drill.step_sleep_s=0.3"]
    job = cluster.sbatch(args, cwd=tmp_path, env=env)
    run_dir = tmp_path / "runs" / f"slurm-{job}"
    wait_for(run_dir / "checkpoints" / f"step-{EVERY:08d}" / "COMPLETE", 600, tmp_path, job)
    first = cluster.client(["scontrol", "show", "hostnames", cluster.job_info(job)["NodeList"]]).stdout.split()
    assert len(first) == JOB_NODES, first
    victim = first[3]  # not the head node: the rendezvous stays where it was; the replica on nodes 3+4 loses a shard
    killed_at = max(train_losses(run_dir))
    assert cluster.kill_node(victim), f"nothing ran on {victim}"

    info = wait_requeued_and_completed(cluster, job, tmp_path, timeout=900)
    nodes = cluster.client(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    text = job_log(tmp_path, job)
    resumed = [int(s) for s in re.findall(r"resumed from step (\d+)", text)]
    requeued = events(run_dir, "requeued")
    losses = train_losses(run_dir)
    done = json.loads((run_dir / "DONE").read_text())
    drained = {n: s for n, s in cluster.node_states().items() if s not in ("idle", "allocated", "mixed")}
    summary = [
        f"eight-node drill: job {job} on {','.join(first)}",
        f"eight-node drill: node killed {victim} (slurmd, slurmstepd, agent, worker) after step {killed_at}",
        f"eight-node drill: requeued: Restarts={info.get('Restarts')}, "
        + (requeued[0]["cause"] if requeued else "no requeued event"),
        f"eight-node drill: requeued run on {','.join(nodes)}; nodes out of service after the failure: {drained}",
        f"eight-node drill: resumed from step {resumed[-1] if resumed else None}",
        f"eight-node drill: final step {done.get('step')}, losses of steps 1-{max(losses)} equal to the uninterrupted "
        f"run: {losses == reference}; {job_cpu_s(tmp_path / 'cpu.log'):.0f} CPU-s in the job's waited-for processes",
    ]
    print("\n" + "\n".join(summary))
    assert int(info.get("Restarts", "0")) == 1, info
    assert victim not in nodes and len(nodes) == JOB_NODES, (victim, nodes)  # requeued onto 8 other nodes
    assert requeued and victim not in requeued[0]["nodes"], requeued
    assert resumed and EVERY <= resumed[-1] < STEPS and resumed[-1] % EVERY == 0, (resumed, text[-3000:])
    assert done.get("step") == STEPS and sorted(losses) == list(range(1, STEPS + 1))
    assert losses == reference  # bit-identical, every step


# ---- the same 8 nodes under torchft: 4 replica groups of 2 nodes, supervised ------------------------------------
GROUPS, KILL_AT = 4, 3
TOL = 1e-5  # the DP layouts' parity tolerance (tests/distributed/test_replica_ft_groups.py)
FT_OVERRIDES = [
    *(o for o in OVERRIDES if not o.startswith(("parallelism", "train.global_batch_size", "checkpoint."))),
    "parallelism=fsdp",
    "parallelism.dp_shard=2",  # a group: 2 nodes, one FSDP rank each
    "train.global_batch_size=2",  # per group: 4 participating groups read the reference's global batch of 8
    f"checkpoint.every_steps={STEPS}",  # every group's final state, compared below
    "fault.drill.step_sleep_s=15",  # the survivors train on while Slurm sees the node fail and the group comes back
    "fault.replica_timeout_s=10",
    "fault.replica_quorum_timeout_s=240",
]


def records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def restore_nodes(cluster) -> None:
    """Every node back in service (the drill before this one leaves a node down and one drained)."""
    for node, state in cluster.node_states().items():
        if state.endswith("*") or state.startswith("down"):
            cluster.kill_node(node)  # whatever is left of the dead node, then a fresh slurmd
            cluster.start_slurmd(node)
        if state not in ("idle", "allocated", "mixed"):
            cluster.client(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    cluster.wait_idle(CLUSTER_NODES, timeout=240)


def supervisor(cluster, tmp: Path) -> list:
    return [
        *("nsenter", f"--net=/run/netns/{cluster.ns[cluster.nodes[0]]}", sys.executable, "-m"),
        *("lmforge.launch.replica_ft_slurm", "--replicas", str(GROUPS), "--nodes-per-group", "2", "--name", "ft8"),
        *("--lighthouse-node", "node1", "--sbatch-arg=--exclusive", "--max-resubmits", "1", "--poll-s", "0.5"),
        *("--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "20000", "--port", "29537"),
        *("--", f"run.root={tmp}/runs", *FT_OVERRIDES),
    ]


def wait_all_trained(run: Path, victim_group: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``victim_group`` has committed a step >= KILL_AT, the four groups together."""
    deadline = time.monotonic() + timeout
    group = run / f"replica-{victim_group}"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the supervisor ended before the kill"
        try:
            full = [r for r in records(group / "replica_ft" / "membership.jsonl") if r["replicas"] == [0, 1, 2, 3]]
        except ValueError:  # a line half written
            full = []
        if full and max([0, *train_losses_or_none(group)]) >= KILL_AT:
            return
        time.sleep(0.2)
    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted((run / "replica_ft").glob("*.*")))
    raise AssertionError(f"the four groups did not train step {KILL_AT} together in {timeout}s\n{logs}")


def train_losses_or_none(run_dir: Path) -> Dict[int, float]:
    """train_losses while the run writes (nothing yet, or a line half written: nothing this time)."""
    try:
        return train_losses(run_dir)
    except (OSError, ValueError):
        return {}


def replayed_tokens(membership: list, steps, per_group: int, seq_len: int) -> Dict[int, int]:
    """step -> tokens seen after it, replaying the committed membership history: a step with n participating groups
    consumes n x ``per_group`` samples (the membership of a step is that of the newest record at or before it)."""
    changes = sorted((r["step"], len(r["replicas"])) for r in membership if r.get("committed", True))
    out, consumed = {}, 0
    for step in range(1, max(steps) + 1):
        n = [count for at, count in changes if at <= step][-1]
        consumed += n * per_group
        out[step] = consumed * seq_len
    return {s: out[s] for s in steps}


def train_records(run_dir: Path) -> Dict[int, dict]:
    return {r["step"]: r for r in records(run_dir / "metrics.jsonl") if r.get("kind") == "train"}


def weights_digest(ckpt: Path) -> str:
    """SHA-256 of a checkpoint's consolidated weights, by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(load_full_model_state(ckpt)[1].items()):
        digest.update(name.encode() + tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.timeout(1200)
def test_eight_nodes_under_torchft_lose_a_node_the_other_groups_train_on_and_the_group_heals(
    cluster, reference, tmp_path, data_cache
):
    restore_nodes(cluster)
    env = {**cluster.env, **job_env(data_cache, tmp_path)}
    proc = subprocess.Popen(
        supervisor(cluster, tmp_path),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run, victim, vg = tmp_path / "runs" / "ft8", "", 2  # vg: the group that loses a node
    try:
        wait_all_trained(run, vg, proc, timeout=480)
        log = records(run / "replica_ft" / "supervisor.jsonl")
        first = {e["replica"]: e["nodes"] for e in log if e["event"] == "start" and e["role"] == "group"}
        victim = first[vg][0]  # the group's head node: its rank 0, ManagerServer and rendezvous store
        killed_step, killed_at = max(train_losses(run / f"replica-{vg}")), time.time()
        assert cluster.kill_node(victim), f"nothing ran on {victim}"
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # SIGTERM: the supervisor cancels every job
            proc.terminate()
            proc.communicate(timeout=60)
        if victim:
            cluster.start_slurmd(victim)
    assert proc.returncode == 0, out

    # Slurm and the supervisor: NODE_FAIL, the node excluded, the group resubmitted elsewhere; the others once
    log = records(run / "replica_ft" / "supervisor.jsonl")
    subs = {i: [e for e in log if e["event"] == "submit" and e.get("replica") == i] for i in range(GROUPS)}
    assert [len(subs[i]) for i in range(GROUPS)] == [1, 1, 2, 1], log
    old, new = subs[vg][0]["job"], subs[vg][1]["job"]
    end = next(e for e in log if e["event"] == "end" and e["job"] == old)
    assert (end["state"], sorted(end["nodes"])) == ("NODE_FAIL", sorted(first[vg])), end
    excluded = {e["node"]: e for e in log if e["event"] == "exclude"}
    assert victim in excluded and set(excluded) <= set(first[vg]), excluded
    assert excluded[victim]["reason"].startswith(f"job {old} ended NODE_FAIL; Slurm reports {victim} down"), excluded
    assert subs[vg][1]["exclude"] == sorted({"node1", *excluded}), subs[vg]
    info = cluster.job_info(new)  # Slurm's own record of the resubmitted job
    exc = cluster.client(["scontrol", "show", "hostnames", info["ExcNodeList"]]).stdout.split()
    nodes = cluster.client(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    assert exc == sorted({"node1", *excluded}) and info["JobState"] == "COMPLETED", info
    assert victim not in nodes and len(nodes) == 2, nodes
    assert [e["rc"] for e in log if e["event"] == "exit"] == [0], log

    # the membership: four groups, then the three survivors committing without the dead group, then four again with
    # the resubmitted group healed from a peer (rank for rank) at a step the survivors record with the same digests
    members = {i: records(run / f"replica-{i}" / "replica_ft" / "membership.jsonl") for i in range(GROUPS)}
    committed = {i: [r for r in members[i] if r.get("committed", True)] for i in range(GROUPS)}
    survivors = [i for i in range(GROUPS) if i != vg]
    shrunk = [r for r in committed[0] if r["replicas"] == survivors and r["step"] > killed_step]
    assert shrunk, committed[0]
    rejoin = next(r for r in committed[vg] if r["healed"] and r["time"] > killed_at)
    assert rejoin["replicas"] == list(range(GROUPS)) and rejoin["step"] > shrunk[0]["step"], committed[vg]
    for i in survivors:
        peer = next(r for r in committed[i] if r["step"] == rejoin["step"])
        assert peer["healed_replicas"] == [vg] and peer["state_sha256_ranks"] == rejoin["state_sha256_ranks"], peer
    # negative control: the state the resubmitted group's ranks held before healing is not what they healed to
    assert all(b != a for b, a in zip(rejoin["state_sha256_before_heal_ranks"], rejoin["state_sha256_ranks"]))

    # the replay: every committed step's data position is that of the recorded membership history (n groups read
    # n x 2 samples), and the steps all four groups trained from the same start are the HSDP run's, within TOL
    seq_len = next(iter(train_records(run / "replica-0").values()))["tokens_seen"] // (GROUPS * 2)
    for i in survivors:
        recs = train_records(run / f"replica-{i}")
        assert sorted(recs) == list(range(1, STEPS + 1)), (i, sorted(recs))
        logged = {s: r["tokens_seen"] for s, r in recs.items()}
        assert logged == replayed_tokens(members[i], logged, 2, seq_len), (i, logged, members[i])
        # negative control: a replay that ignores the history (four groups throughout) is not what was trained
        assert logged != replayed_tokens([{"step": 1, "replicas": list(range(GROUPS))}], logged, 2, seq_len)
    full = [s for s in range(1, STEPS + 1) if s < shrunk[0]["step"]]  # four groups from step 1 on, before the kill
    assert committed[0][0]["step"] == 1 and committed[0][0]["replicas"] == list(range(GROUPS)), committed[0]
    assert full and killed_step in full, (full, killed_step)
    gaps = [abs(train_records(run / f"replica-{i}")[s]["loss"] - reference[s]) for i in range(GROUPS) for s in full]
    assert max(gaps) < TOL, gaps
    # negative control: after the shrink the groups trained other batches than the uninterrupted run
    after = train_records(run / "replica-0")[STEPS]["loss"]
    assert abs(after - reference[STEPS]) > 100 * TOL, (after, reference[STEPS])
    digests = [weights_digest(run / f"replica-{i}" / "checkpoints" / f"step-{STEPS:08d}") for i in range(GROUPS)]
    assert len(set(digests)) == 1, digests

    t = {e["event"] + str(e.get("job")): e["time"] for e in log}
    placed = "; ".join(f"{i}: {','.join(first[i])}" for i in range(GROUPS))
    summary = [
        f"torchft eight-node drill: groups {placed}; Lighthouse on node1",
        f"torchft eight-node drill: node killed {victim} (group {vg}'s head) after step {killed_step}",
        f"torchft eight-node drill: NODE_FAIL seen at {t['end' + old] - killed_at:.1f} s; resubmitted at "
        f"{t['submit' + new] - killed_at:.1f} s excluding {','.join(exc)}; running on {','.join(nodes)} at "
        f"{t['start' + new] - killed_at:.1f} s",
        f"torchft eight-node drill: groups {survivors} committed steps {shrunk[0]['step']}-{rejoin['step'] - 1} without "
        f"group {vg}; group {vg} healed at step {rejoin['step']}, {rejoin['time'] - killed_at:.1f} s after the kill",
        f"torchft eight-node drill: final step {STEPS}, 4 groups' final weights equal; steps {full[0]}-{full[-1]} "
        f"within {max(gaps):.1e} of the HSDP run; data positions equal the membership replay; "
        f"{job_cpu_s(tmp_path / 'cpu.log'):.0f} CPU-s in the job's waited-for processes",
    ]
    print("\n" + "\n".join(summary))

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
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
sys.path.insert(0, str(TESTS / "slurm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import SlurmCluster, unavailable_reason  # noqa: E402
from test_doc_commands_slurm import cpu_counting_python, job_cpu_s  # noqa: E402

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

"""A node at fault is left out of the requeued job's next run, on the real Slurm cluster (cluster.py).

Two 2-node jobs side by side. In each, every rank on one node is slowed by the drill (``fault.drill.slow_host``), so
the straggler detector flags that node at every gather; rank 0 is then killed with no torchrun restart left, so
the job requeues. The slow node stays up the whole time: only the exclusion can keep the next run off it.

* ``exclude`` (node1+node2, node2 slow): the next run runs on two other nodes, with the losses of the uninterrupted
  local run bit for bit. Before the fault the test also tries what Slurm refuses on a running job
  (``scontrol update ExcNodeList=``), the negative control.
* ``shrink`` (node3+node4, node4 slow, ``cluster.min_nodes=1``, ``parallelism.dp_replicate=${cluster.nodes}``): the
  next run asks for one node, trains at DP 1 with twice the accumulation from the step-10 checkpoint and completes.
"""

from __future__ import annotations

import json

import pytest
from conftest import MAX_STEPS, TRAIN_OVERRIDES, events, train_losses
from test_slurm_train import logs, submit, wait_completed

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]


def faulty_node(host):
    return [
        f"fault.drill.slow_host={host}",
        "fault.drill.slow_s=0.4",
        "metrics.straggler_every=3",  # gathers at steps 3, 6, 9 and 12 (TRAIN_OVERRIDES' 5 overridden)
        "fault.exclude_straggler_flags=2",
        "fault.max_restarts=0",
        "cluster.max_requeues=1",
        "fault.drill.kill_step=14",
        "fault.drill.kill_rank=0",
    ]


assert "metrics.straggler_every=5" in TRAIN_OVERRIDES
SHRINK = ["cluster.min_nodes=1", "parallelism.dp_replicate=${cluster.nodes}"]
TOLERANCE = 1e-5  # relative: the same samples' gradient summed in another order (tests/distributed/test_dp_shrink.py)


@pytest.fixture(scope="module")
def jobs(slurm_cluster, job_env, tmp_path_factory):
    slurm_cluster.wait_idle(4, timeout=300)  # after the other modules' jobs
    tmp = tmp_path_factory.mktemp("exclusion")
    out = {
        "exclude": submit(slurm_cluster, tmp, "exclude", faulty_node("node2"), job_env, ["--nodelist=node1,node2"]),
        "shrink": submit(
            slurm_cluster, tmp, "shrink", faulty_node("node4") + SHRINK, job_env, ["--nodelist=node3,node4"]
        ),
    }
    # Negative control: what jobctl did before, an exclusion while the job runs. Slurm refuses it; nothing changes.
    job = out["exclude"][0]
    slurm_cluster.wait_state(job, {"RUNNING"}, timeout=120)
    refused = slurm_cluster.client(["scontrol", "update", f"JobId={job}", "ExcNodeList=node2"], check=False)
    out["refused"] = (refused.returncode, refused.stdout + refused.stderr, slurm_cluster.job_info(job)["ExcNodeList"])
    return out


def check_excluded(cluster, job, root, run_dir, bad, nodes_next):
    """The next run left ``bad`` out (``nodes_next`` nodes), said so in the log, recorded it in the run directory."""
    info = wait_completed(cluster, job, root, timeout=420, restarts=1)
    text = logs(root, job)
    ran_on = cluster.client(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    assert bad not in ran_on and len(ran_on) == nodes_next, (ran_on, text[-4000:])
    assert info["ExcNodeList"] == bad, info
    assert cluster.node_states()[bad] in ("idle", "mixed", "allocated"), cluster.node_states()  # up all along
    assert f"; excluding {bad} ({bad}: flagged as a straggler " in text, text[-4000:]
    assert f"lmforge: excluded {bad} from job {job}'s next run (Slurm ExcNodeList={bad};" in text, text[-4000:]
    assert f"(excluded: {bad})" in text and "resumed from step 10" in text, text[-4000:]

    record = json.loads((run_dir / "excluded_nodes.json").read_text())["nodes"]
    assert list(record) == [bad] and record[bad]["applied"] is True and record[bad]["slurm_restart"] == 0, record
    assert record[bad]["reason"].startswith("flagged as a straggler"), record
    first = json.loads((run_dir / "requeues.json").read_text())["history"][0]
    assert (first["action"], first["kind"], first["excluded"], first["exclusion_applied"]) == (
        "requeue",
        "failure",
        [bad],
        True,
    ), first
    assert first["exclusion_reasons"][bad] == record[bad]["reason"], first
    ev = events(run_dir)
    names = [e["event"] for e in ev]
    first_run, second_run = ev[: names.index("requeued")], ev[names.index("requeued") :]
    flagged = [e["host"] for e in first_run if e["event"] == "straggler"]
    assert len(flagged) >= 2 and set(flagged) == {bad}, flagged  # only the slowed node, at every gather
    assert bad not in {e.get("host") for e in second_run}, second_run
    assert second_run[0]["excluded"] == [bad] and bad not in second_run[0]["nodes"], second_run[0]
    return text, first


@pytest.mark.timeout(600)
def test_a_straggler_node_is_excluded_from_the_requeued_run(slurm_cluster, jobs, local_reference):
    code, said, exc = jobs["refused"]
    assert code != 0 and "Job is no longer pending execution" in said and exc == "(null)", jobs["refused"]
    job, root, run_dir = jobs["exclude"]
    check_excluded(slurm_cluster, job, root, run_dir, "node2", nodes_next=2)
    assert train_losses(run_dir) == local_reference  # completed on the others, the same losses


@pytest.mark.timeout(600)
def test_an_exclusion_shrinks_data_parallelism_when_the_layout_follows_the_nodes(slurm_cluster, jobs, local_reference):
    job, root, run_dir = jobs["shrink"]
    text, first = check_excluded(slurm_cluster, job, root, run_dir, "node4", nodes_next=1)
    assert "the next run asks for 1 node (an elastic shrink, cluster.min_nodes)" in text, text[-4000:]
    assert first["next_nodes"] == 1, first
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    # Up to the checkpoint: DP 2, the local run's losses bit for bit; after it: DP 1 with twice the accumulation,
    # the same samples, within parity tolerance.
    assert [losses[s] for s in range(1, 11)] == [local_reference[s] for s in range(1, 11)]
    for s in range(11, MAX_STEPS + 1):
        assert abs(losses[s] - local_reference[s]) <= TOLERANCE * abs(local_reference[s]), (s, losses[s])

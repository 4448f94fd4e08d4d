"""A node at fault is left out of the requeued job's next run, on the real Slurm cluster (cluster.py).

One 2-node job on node1+node2: every rank on node2 is slowed by the drill (``fault.drill.slow_host``), so the
straggler detector flags node2 at every gather; rank 0 is then killed with no torchrun restart left, so the job
requeues. node2 stays up the whole time: only the exclusion can keep the next run off it. Before the fault, the
test also tries what Slurm refuses on a running job (``scontrol update ExcNodeList=``), the negative control.
"""

from __future__ import annotations

import json

import pytest
from conftest import TRAIN_OVERRIDES, events, train_losses
from test_slurm_train import logs, submit, wait_completed

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

OVERRIDES = [
    "fault.drill.slow_host=node2",
    "fault.drill.slow_s=0.4",
    "metrics.straggler_every=3",
    "fault.exclude_straggler_flags=2",
    "fault.max_restarts=0",
    "cluster.max_requeues=1",
    "fault.drill.kill_step=14",
    "fault.drill.kill_rank=0",
]
assert "metrics.straggler_every=5" in TRAIN_OVERRIDES  # overridden above: gathers at steps 3, 6, 9 and 12


@pytest.mark.timeout(600)
def test_a_straggler_node_is_excluded_from_the_requeued_run(slurm_cluster, job_env, tmp_path_factory, local_reference):
    slurm_cluster.wait_idle(4, timeout=300)  # the next run needs node3 or node4
    tmp = tmp_path_factory.mktemp("exclusion")
    job, root, run_dir = submit(slurm_cluster, tmp, "exclude", OVERRIDES, job_env, sbatch=["--nodelist=node1,node2"])

    # Negative control: what jobctl did before, an exclusion while the job runs. Slurm refuses it; nothing changes.
    slurm_cluster.wait_state(job, {"RUNNING"}, timeout=120)
    refused = slurm_cluster.client(["scontrol", "update", f"JobId={job}", "ExcNodeList=node2"], check=False)
    assert refused.returncode != 0 and "Job is no longer pending execution" in refused.stdout + refused.stderr
    assert slurm_cluster.job_info(job)["ExcNodeList"] == "(null)"

    info = wait_completed(slurm_cluster, job, root, timeout=420, restarts=1)
    text = logs(root, job)
    next_nodes = slurm_cluster.client(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    assert "node2" not in next_nodes and len(next_nodes) == 2, (next_nodes, text[-4000:])
    assert info["ExcNodeList"] == "node2", info
    assert slurm_cluster.node_states()["node2"] in ("idle", "mixed", "allocated"), slurm_cluster.node_states()

    # The job log says what was excluded, why, and that Slurm took it; the next run's start names it too.
    assert "; excluding node2 (node2: flagged as a straggler " in text, text[-4000:]
    assert f"lmforge: excluded node2 from job {job}'s next run (Slurm ExcNodeList=node2;" in text, text[-4000:]
    assert "(excluded: node2)" in text and "resumed from step 10" in text, text[-4000:]

    # The run directory: excluded_nodes.json and the requeue's requeues.json entry.
    record = json.loads((run_dir / "excluded_nodes.json").read_text())["nodes"]
    assert list(record) == ["node2"] and record["node2"]["applied"] is True, record
    assert record["node2"]["reason"].startswith("flagged as a straggler") and record["node2"]["slurm_restart"] == 0
    first = json.loads((run_dir / "requeues.json").read_text())["history"][0]
    assert (first["action"], first["kind"], first["excluded"], first["exclusion_applied"]) == (
        "requeue",
        "failure",
        ["node2"],
        True,
    ), first
    assert first["exclusion_reasons"]["node2"] == record["node2"]["reason"], first
    ev = events(run_dir)
    names = [e["event"] for e in ev]
    first_run, second_run = ev[: names.index("requeued")], ev[names.index("requeued") :]
    flagged = [e["host"] for e in first_run if e["event"] == "straggler"]
    assert len(flagged) >= 2 and set(flagged) == {"node2"}, flagged  # only the slowed node, at every gather
    assert "node2" not in {e.get("host") for e in second_run}, second_run
    assert second_run[0]["excluded"] == ["node2"] and "node2" not in second_run[0]["nodes"], second_run[0]

    # The job completed on the others, with the losses of the uninterrupted local run.
    assert train_losses(run_dir) == local_reference

"""Nodes at fault (fault/bad_nodes.py) and the requeue record they feed (fault/retry.py): which nodes a requeue
leaves out and why, and the attempt Slurm requeued by itself, recorded at the next run's start."""

from __future__ import annotations

import json

from lmforge.fault import bad_nodes
from lmforge.fault.retry import load_state, record, record_slurm_requeue


def event(name, **fields):
    return json.dumps({"kind": "event", "event": name, "step": 1, "rank": -1, "cause": "", **fields}) + "\n"


def write_metrics(run, lines):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(lines) + '{"kind": "train", "step": 3, "loss": 1.0}\n{torn')


def test_a_node_flagged_enough_times_in_the_run_that_ended_is_at_fault(tmp_path):
    run = tmp_path / "run"
    earlier = [event("straggler", host="node1.cluster")] * 5  # a run before the last requeue: not counted
    this_run = [event("requeued"), *[event("straggler", host="node2.cluster")] * 3, event("straggler", host="node3")]
    write_metrics(run, earlier + this_run)
    assert bad_nodes.straggler_flags(run) == {"node2": 3, "node3": 1}
    nodes = ["node1", "node2", "node3"]
    reasons = bad_nodes.at_fault(run, nodes, {"node3": "down*", "node9": "down"}, straggler_limit=3)
    assert reasons == {
        "node2": "flagged as a straggler 3 times in this run (fault.exclude_straggler_flags=3)",
        "node3": "Slurm reports it down*",
    }
    assert bad_nodes.at_fault(run, nodes, {}, straggler_limit=4) == {}
    assert bad_nodes.at_fault(run, nodes, {}, straggler_limit=0) == {}  # 0: stragglers never exclude


def test_exclusions_are_recorded_with_their_reason_in_the_run_and_the_requeue(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    run = tmp_path / "run"
    why = {"node2": "Slurm reports it drained"}
    decision = record(run, 1, signalled=False, max_failures=2, nodes=["node1", "node2"], exclusions=why)
    entry = load_state(run)["history"][-1]
    assert decision.action == "requeue" and entry["excluded"] == ["node2"] and entry["exclusion_reasons"] == why
    bad_nodes.save(run, why, job="77", slurm_restart=0, applied=False, error="scontrol update: Invalid node name")
    assert bad_nodes.excluded(run) == {}  # refused by Slurm: recorded, not counted as excluded
    bad_nodes.save(run, why, job="77", slurm_restart=0, applied=True, error="")
    saved = bad_nodes.load(run)["node2"]
    assert (saved["reason"], saved["job"], saved["applied"]) == ("Slurm reports it drained", "77", True)
    assert list(bad_nodes.excluded(run)) == ["node2"]
    (run / "DONE").write_text("{}")  # a decision other than requeue records no exclusion
    assert record(run, 0, signalled=False, max_failures=2, exclusions=why).action == "done"
    assert load_state(run)["history"][-1]["excluded"] == []


def test_an_attempt_slurm_requeued_by_itself_is_recorded_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    run = tmp_path / "run"
    run.mkdir()
    entry = record_slurm_requeue(run, run=0, nodes=["node1", "node2"], unhealthy={"node2": "down*"})
    assert (entry["kind"], entry["slurm_restart"], entry["lost_nodes"]) == ("node_failure", 0, {"node2": "down*"})
    assert entry["reason"] == "node failure: node2 is down*; Slurm requeued run 1 itself; resuming from step 0"
    assert entry["recorded_at"] == "start of run 2"
    assert load_state(run)["failures"] == 1
    assert record_slurm_requeue(run, run=0, nodes=["node1", "node2"], unhealthy={}) is None  # recorded once
    # The nodes are up again (or an operator requeued it): recorded, no retry spent.
    again = record_slurm_requeue(run, run=1, nodes=["node1", "node3"], unhealthy={"node9": "down"}, exit_code=1)
    assert (again["kind"], again["lost_nodes"], again["exit_code"]) == ("slurm_requeue", {}, 1)
    assert load_state(run)["failures"] == 1
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["decision"]) for e in events] == [("requeue", "node_failure"), ("requeue", "slurm_requeue")]


SHRINKABLE = [
    "model=tiny",
    "parallelism=ddp",
    "parallelism.dp_replicate=${cluster.nodes}",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.device=cpu",
]


def test_a_job_shrinks_after_an_exclusion_only_when_allowed_and_the_layout_fits(monkeypatch):
    from lmforge.launch.jobctl import shrunk_node_count
    from lmforge.runtime.env_vars import environment

    added = {"LMFORGE_JOB_OVERRIDES": "cluster.nodes=2"}  # what prepare appended from the allocation
    job = SHRINKABLE + ["cluster.nodes=2"]
    assert shrunk_node_count(job, added, total=2, excluded=1, min_nodes=1) == (1, "")
    monkeypatch.setenv("LMFORGE_JOB_OVERRIDES", "cluster.nodes=2")  # as train.sh exports it
    assert shrunk_node_count(job, environment(), total=2, excluded=1, min_nodes=1) == (1, "")
    assert shrunk_node_count(job, added, total=2, excluded=1, min_nodes=0) == (None, "")  # 0: never
    assert shrunk_node_count(job, added, total=2, excluded=0, min_nodes=1) == (None, "")  # nothing excluded
    assert shrunk_node_count(job, added, total=4, excluded=3, min_nodes=2)[0] == 2  # not below min_nodes
    assert shrunk_node_count(job, {}, total=2, excluded=1, min_nodes=1) == (
        None,
        "cluster.nodes=2 is fixed on the command line (drop it to let the job shrink)",
    )
    fixed = [o.replace("${cluster.nodes}", "2") for o in job]
    shrink, why = shrunk_node_count(fixed, added, total=2, excluded=1, min_nodes=1)
    assert shrink is None and why.startswith("the layout is not valid on 1 nodes (config key 'parallelism'"), why


def corrupted(step=20, hosts=(), **fields):
    return event("corrupted", step=step, hosts=list(hosts), last_good_step=10, **fields)


def test_silent_data_corruption_excludes_the_host_only_when_the_check_names_it(tmp_path):
    run = tmp_path / "run"
    earlier = [corrupted(hosts=["node1"])]  # a run before the last requeue: not counted
    write_metrics(run, earlier + [event("requeued"), corrupted(hosts=["node2.cluster"], ranks=[2])])
    nodes = ["node1", "node2", "node3"]
    assert bad_nodes.at_fault(run, nodes, {}, straggler_limit=0) == {
        "node2": "silent data corruption on its replica at step 20 (fault.consistency_every)"
    }
    assert bad_nodes.at_fault(run, nodes, {"node2": "drained"}, 0) == {"node2": "Slurm reports it drained"}
    assert bad_nodes.at_fault(run, ["node1", "node3"], {}, 0) == {}  # not a node of this attempt
    group = tmp_path / "group"  # a torchft group named by the check across groups: its hosts
    write_metrics(group, [corrupted(step=3, hosts=["node4", "node5"], replica_groups=[1])])
    assert bad_nodes.at_fault(group, ["node4", "node5"], {}, 0) == {
        n: "silent data corruption on its replica group's state at step 3 (fault.consistency_every)"
        for n in ("node4", "node5")
    }
    # Negative control: an ambiguous finding (a pair of replicas, a tie) names no host and excludes nobody.
    ambiguous = tmp_path / "ambiguous"
    write_metrics(ambiguous, [corrupted(ranks=[0, 1]), corrupted(step=3, replica_groups=[0, 1])])
    assert bad_nodes.at_fault(ambiguous, nodes, {}, straggler_limit=0) == {}


def checkpoint(run, step, pinned=False):
    path = run / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("")
    (path / "state.json").write_text("{}")
    if pinned:
        (path / "PINNED").write_text("last checkpoint before the replica mismatch found at step 20")
    return path


def test_corruption_on_a_named_host_is_requeued_without_it_from_the_checkpoint_before(tmp_path, monkeypatch):
    from lmforge.checkpoint.layout import latest
    from lmforge.fault.verdict import Verdict, VerdictKind, write

    monkeypatch.setenv("SLURM_JOB_ID", "79")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    run = tmp_path / "run"
    write_metrics(run, [corrupted(hosts=["node2"], ranks=[2])])
    good, suspect = checkpoint(run, 10, pinned=True), checkpoint(run, 15)  # step 15 may hold corrupt weights
    write(run, Verdict(VerdictKind.CORRUPTED, 0, 20, "silent data corruption", 47))
    why = bad_nodes.at_fault(run, ["node1", "node2", "node3"], {}, straggler_limit=0)
    decision = record(run, 47, signalled=False, max_failures=2, nodes=["node1", "node2", "node3"], exclusions=why)
    assert (decision.action, decision.kind) == ("requeue", "corrupted"), decision
    assert decision.reason.startswith(
        "silent data corruption at step 20 on node2: requeued without it (retry 1 of 2), resuming from the newest "
        "checkpoint at or before step 10, the last agreeing check"
    )
    entry = load_state(run)["history"][-1]
    assert entry["excluded"] == ["node2"] and entry["suspect_checkpoints"] == [suspect.name]
    assert latest(run / "checkpoints") == good and (run / "suspect_checkpoints" / suspect.name / "COMPLETE").exists()
    assert load_state(run)["failures"] == 1


def test_corruption_stops_when_no_host_is_named_excluded_or_the_budget_is_spent(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "80")
    nodes = ["node1", "node2"]
    ambiguous = tmp_path / "ambiguous"  # a pair of replicas: nothing tells which is wrong
    write_metrics(ambiguous, [corrupted(ranks=[0, 1])])
    checkpoint(ambiguous, 15)
    stop = record(ambiguous, 47, signalled=False, max_failures=2, nodes=nodes, exclusions={})
    assert (stop.action, stop.kind, stop.word(47).split()) == ("stop", "corrupted", ["stop", "47"])
    assert (ambiguous / "checkpoints" / "step-00000015").exists()  # nothing moved on a stop
    named = tmp_path / "named"
    write_metrics(named, [corrupted(hosts=["node2"])])
    assert record(named, 47, signalled=False, max_failures=2, nodes=nodes, exclusions={}).action == "stop"
    why = bad_nodes.at_fault(named, nodes, {}, straggler_limit=0)
    assert record(named, 47, signalled=False, max_failures=0, nodes=nodes, exclusions=why).action == "stop"
    assert record(named, 47, signalled=False, max_failures=1, nodes=nodes, exclusions=why).action == "requeue"

"""The Slurm supervisor of a torchft run: its sbatch command lines, its bad-input refusals, what counts as a finished
group and as an unhealthy node (python -m lmforge.launch.replica_ft_slurm, in-process; the runs themselves are in
tests/slurm/test_slurm_replica_ft.py)."""

from __future__ import annotations

import json

import pytest

from lmforge.launch.replica_ft_slurm import Supervisor, finished, main, parse
from lmforge.launch.slurm_queue import unhealthy


def test_dry_run_prints_the_lighthouse_job_and_one_job_per_group(capsys, tmp_path):
    argv = ["--replicas", "3", "--name", "ft", "--port", "29600", "--lighthouse-node", "svc1", "--exclude", "bad7"]
    assert main([*argv, "--sbatch-arg=--time=48:00:00", "--dry-run", "--", f"run.root={tmp_path}", "model=tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("sbatch ") for line in lines)
    assert "--nodelist=svc1 --exclude=bad7" in lines[0] and "--no-requeue --export=ALL,LMFORGE_REPO=" in lines[0]
    assert lines[0].endswith(
        "slurm/torchft_lighthouse.sh --min_replicas 2 --bind 0.0.0.0:29600 --join_timeout_ms 30000 "
        "--heartbeat_timeout_ms 5000"
    )
    for i, line in enumerate(lines[1:]):
        assert f"--job-name=ft-r{i} --nodes=1 --ntasks-per-node=1 --no-requeue --export=ALL,LMFORGE_REPO=" in line
        assert " --exclude=bad7,svc1 " in line
        assert f"--output={tmp_path}/ft/replica_ft/replica-{i}-%j.out" in line and "--time=48:00:00 " in line
        assert line.endswith(
            f"slurm/train.sh run.root={tmp_path} model=tiny run.name=ft/replica-{i} fault.replica_ft=torchft "
            f"fault.replica_groups=3 fault.replica_id={i} fault.replica_min=2 fault.lighthouse=http://svc1:29600 "
            "cluster.max_requeues=0"
        )
    assert not (tmp_path / "ft").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--replicas", "2", "--min-replicas", "1"], "--min-replicas 1 is not a majority of --replicas 2"),
        (["--replicas", "3", "--min-replicas", "4"], "--min-replicas 4 is not a majority of --replicas 3"),
        (["--replicas", "2", "--nodes-per-group", "0"], "--nodes-per-group 0 must be at least 1"),
        (["--replicas", "2", "--max-resubmits", "-1"], "--max-resubmits -1 must be at least 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"torchft_supervisor.sh: {said}") and "Fix:" in err
    assert main(["--replicas", "2", "--min-replicas", "2", "--dry-run"]) == 0  # control: the majority of 2 is 2


def test_a_group_is_finished_only_when_its_job_ended_done(tmp_path):
    assert not finished(tmp_path, "7")  # no requeues.json yet
    history = [{"job": "7", "action": "stop"}, {"job": "8", "action": "done"}]
    (tmp_path / "requeues.json").write_text(json.dumps({"history": history}))
    assert finished(tmp_path, "8") and not finished(tmp_path, "7")


@pytest.mark.parametrize(
    "state, bad",
    [("down*", True), ("idle*", True), ("drained", True), ("draining", True), ("fail", True), ("idle", False)]
    + [("mixed", False), ("allocated", False)],
)
def test_unhealthy_node_states(state, bad):
    assert unhealthy(state) is bad


def test_the_run_stops_once_the_groups_left_cannot_reach_a_quorum(tmp_path):
    sup = Supervisor(parse(["--replicas", "3", "--name", "q", "--", f"run.root={tmp_path}"]))  # min 2 of 3
    assert sup.quorum_lost() == ""
    sup.groups[0].final_rc = 0  # finished: not a loss
    sup.groups[1].final_rc = 2
    assert sup.quorum_lost() == "replica group(s) 1 given up: the 1 left cannot reach --min-replicas 2"
    sup.groups[0].final_rc = None  # two still running: they commit without group 1
    assert sup.quorum_lost() == ""
    assert not (tmp_path / "q").exists()  # nothing submitted, nothing written


def write_group_ledger(run, started: float, steps: int) -> None:
    """A replica group's goodput ledger (fault/goodput_ledger.py): one launch, ``steps`` steps of 1 s, 100 tokens each."""
    lines = [{"kind": "start", "launch": 0, "tokens_per_step": 100, "world_size": 1, "load_s": 0.0, "replicas": 2}]
    lines[0].update(process_start=started, loop_start=started + 2.0, start_step=0)
    lines += [{"s": s, "w": 0.0, "d": 1.0, "t": started + 2.0 + s} for s in range(1, steps + 1)]
    lines.append({"kind": "end", "t": started + 2.0 + steps, "step": steps, "reason": "done"})
    (run / "goodput").mkdir(parents=True)
    (run / "goodput" / "launch-000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_supervisor_writes_the_jobs_goodput_when_it_exits(tmp_path, capsys):
    sup = Supervisor(parse(["--replicas", "2", "--name", "ft", "--", f"run.root={tmp_path}"]))
    sup.folder.mkdir(parents=True)
    for g in sup.groups.values():  # both finished: nothing to cancel (no scancel)
        g.final_rc = 0
    # control first: no group wrote a ledger: one warning line, no goodput.json, the exit code unchanged
    assert sup.stop("every group finished", 0) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"lmforge: warning: the job's goodput.json not written: no replica group under {tmp_path / 'ft'} wrote a "
        "goodput ledger (none trained)"
    )
    assert not (tmp_path / "ft" / "goodput.json").exists()
    # group 0 starts at t=0 and group 1 at t=1, each 2 s of startup then 4 steps of 1 s: the job's wall is 7 s, its
    # 800 tokens against 2 groups x 100 tokens/s x 7 s
    write_group_ledger(tmp_path / "ft" / "replica-0", 0.0, 4)
    write_group_ledger(tmp_path / "ft" / "replica-1", 1.0, 4)
    assert sup.stop("every group finished", 0) == 0
    report = json.loads((tmp_path / "ft" / "goodput.json").read_text())
    assert (report["replica_groups"], report["wall_s"], report["committed_tokens"]) == (2, 7.0, 800)
    assert report["goodput"] == pytest.approx(800 / (2 * 100 * 7))
    assert report["seconds"]["productive"] == pytest.approx(8.0) and report["seconds"]["startup"] == pytest.approx(5.0)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"lmforge: job goodput 57.1% over 2 replica groups, wall 7.0 s (14.0 replica-seconds); table: lmforge goodput "
        f"{tmp_path / 'ft'}"
    )


def test_a_group_that_stopped_on_corruption_of_its_state_is_resubmitted_without_its_hosts(tmp_path):
    from lmforge.launch.replica_ft_slurm import nodes_at_fault
    from lmforge.launch.slurm_queue import JobState

    def corrupted(run, hosts):
        run.mkdir()
        event = {"kind": "event", "event": "corrupted", "step": 3, "replica_groups": [1], "hosts": hosts}
        (run / "metrics.jsonl").write_text(json.dumps(event) + "\n")
        return run

    named = corrupted(tmp_path / "replica-1", ["node2.cluster", "node3"])
    end = JobState("5", "FAILED", ["node2", "node3"], 47)
    why = "job 5 ended FAILED (exit 47); silent data corruption on its replica group's state at step 3"
    assert nodes_at_fault(end, {}, named) == {n: f"{why} (fault.consistency_every)" for n in ("node2", "node3")}
    assert nodes_at_fault(end, {"node3": "drained"}, named) == {
        "node2": f"{why} (fault.consistency_every)",
        "node3": "job 5 ended FAILED; Slurm reports node3 drained",
    }
    # Negative control: two groups or a tie name no host; a failed job on healthy nodes excludes nothing.
    ambiguous = corrupted(tmp_path / "replica-0", [])
    assert nodes_at_fault(end, {}, ambiguous) == {}
    lost = JobState("6", "NODE_FAIL", ["node4"], -1)
    assert nodes_at_fault(lost, {}, ambiguous) == {"node4": "job 6 ended NODE_FAIL on it"}

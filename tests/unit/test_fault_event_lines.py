"""What a fault event says on the console and in metrics.jsonl: a straggler line leads with the slow rank and its
host (not rank 0, which reports it), and a restart carries the step the launch resumes from (single process)."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from types import SimpleNamespace

import torch

from lmforge.config.schema import RootConfig
from lmforge.fault.events import FaultEvents
from lmforge.fault.hooks import FaultHooks
from lmforge.fault.signals import PreemptionFlag
from lmforge.fault.straggler import StragglerDetector, describe_straggler, gather_hostnames, reference_times
from lmforge.runtime.rundir import RunPaths


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def gathered(times, walls):
    return {"times": times, "wall_times": walls, "references": reference_times(times)}


def test_the_straggler_line_names_the_slow_rank_and_its_host(tmp_path, capsys):
    found = gathered([0.1, 0.3], [0.31, 0.31])
    cause, fields = describe_straggler(found, 1, host="node-b", threshold=1.5, every=4, mode="last local gradient")
    FaultEvents(tmp_path / "metrics.jsonl", rank=0).emit("straggler", 8, cause, rank=1, host="node-b", **fields)
    assert capsys.readouterr().err == (
        "[lmforge fault] straggler rank=1 host=node-b step=8: rank 1 is a straggler on host node-b: mean compute "
        "time 0.300s per step > 1.5 x the median of the other ranks 0.100s over the last 4 steps (compute = loop top "
        "to last local gradient; wall step time 0.310s)\n"
    )
    (event,) = records(tmp_path / "metrics.jsonl")
    assert (event["event"], event["rank"], event["host"], event["slow_rank"], event["step"]) == (
        "straggler", 1, "node-b", 1, 8,
    )  # fmt: skip
    assert event["median_s"] == 0.1 and event["compute_times_s"] == [0.1, 0.3]


def test_an_event_about_this_rank_keeps_its_line(tmp_path, capsys):
    FaultEvents(tmp_path / "metrics.jsonl", rank=3).emit("skipped_step", 5, "loss is nan", consecutive=1)
    assert capsys.readouterr().err == "[lmforge fault] skipped_step rank=3 step=5: loss is nan\n"
    (event,) = records(tmp_path / "metrics.jsonl")
    assert event["rank"] == 3 and "host" not in event


def test_one_process_knows_its_own_host_without_a_collective():
    assert gather_hostnames(torch.device("cpu")) == [socket.gethostname()]
    detector = StragglerDetector(every=4, threshold=1.5, device=torch.device("cpu"))
    assert detector.host(0) == "?"  # before the start-up gather
    detector.hosts = ["node-a", "node-b"]
    assert detector.host(1) == "node-b" and detector.host(2) == "?"


def hooks(tmp_path, start_step):
    base = RootConfig()
    cfg = replace(
        base,
        metrics=replace(base.metrics, straggler_every=0),
        fault=replace(base.fault, consistency_every=0, watchdog_timeout_s=0),
    )
    # engine: none is needed with the compute clock and the replica check off
    return FaultHooks(
        cfg, RunPaths(tmp_path), rank=0, device=torch.device("cpu"), logger=None,
        preemption=PreemptionFlag(), engine=None, start_step=start_step,
    )  # fmt: skip


def test_a_restart_event_carries_the_step_the_launch_resumes_from(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    faults = hooks(tmp_path, start_step=120).start()
    faults.close()
    (event,) = [e for e in records(tmp_path / "metrics.jsonl") if e.get("event") == "restart"]
    assert (event["step"], event["torchrun_restart"], event["rank"]) == (120, 2, 0)
    assert "[lmforge fault] restart rank=0 step=120: torchrun restart 2, Slurm requeue 0" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # control: a first launch records no restart
    fresh = tmp_path / "fresh"
    hooks(fresh, start_step=0).start().close()
    assert not (fresh / "metrics.jsonl").exists() or not [
        e for e in records(fresh / "metrics.jsonl") if e.get("event") == "restart"
    ]


def test_the_replica_check_says_it_compares_the_torchft_groups_with_each_other(tmp_path, capsys):
    """One process per torchft replica group: no replica inside the group; the groups are compared with each other
    (fault/group_check.py, attached once the group joins the torchft job)."""
    base = RootConfig()
    engine = SimpleNamespace(replica_group=None)

    def build(replica_ft: str) -> FaultHooks:
        cfg = replace(
            base,
            metrics=replace(base.metrics, straggler_every=0),
            fault=replace(base.fault, consistency_every=10, watchdog_timeout_s=0, replica_ft=replica_ft),
        )
        return FaultHooks(
            cfg, RunPaths(tmp_path), rank=0, device=torch.device("cpu"), logger=None,
            preemption=PreemptionFlag(), engine=engine, start_step=0,
        )  # fmt: skip

    assert build("torchft").replicas is None
    out = capsys.readouterr().out
    assert "fault.consistency_every=10 compares the torchft replica groups with each other" in out
    assert "no replica inside this group to compare" in out and "compares nothing" not in out
    assert build("none").replicas is None
    assert "compares nothing" not in capsys.readouterr().out  # control: one process without replica FT says nothing

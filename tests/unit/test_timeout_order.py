"""The order of a run's timeouts (config/timeouts.py): the watchdog below the collective timeout, a measured
checkpoint save inside the watchdog's allowance and Slurm's signal lead; the newest save read back from a real
metrics.jsonl (trainer/entry_checks.py) and the warning printed by the start checks (trainer/startup.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lmforge.checkpoint.manager import ResumePoint
from lmforge.config.compose import compose
from lmforge.config.schema import RootConfig
from lmforge.config.timeouts import MeasuredSave, timeout_warnings
from lmforge.metrics.logger import MetricsLogger
from lmforge.metrics.sinks import JsonlSink
from lmforge.trainer.entry_checks import EntryChecks, lines_from_end, newest_save, timeout_lines
from lmforge.trainer.startup import check_start


def config(comm: dict = None, fault: dict = None, cluster: dict = None, device: str = "cpu") -> RootConfig:
    base = RootConfig()
    return replace(
        base,
        comm=replace(base.comm, **(comm or {})),
        fault=replace(base.fault, **(fault or {})),
        cluster=replace(base.cluster, **(cluster or {})),
        train=replace(base.train, device=device),
    )


WATCHDOG_LINE = (
    "lmforge: warning: fault.watchdog_timeout_s=900 is not below comm.collective_timeout_s=600: a hung collective "
    "ends the processes after 600 s, before the watchdog writes their stacks to <run>/dumps; set "
    "fault.watchdog_timeout_s below 600 (e.g. fault.watchdog_timeout_s=450) or comm.collective_timeout_s above 900 "
    "(e.g. comm.collective_timeout_s=1200)"
)


def test_the_defaults_are_in_order():
    cfg = RootConfig()
    assert cfg.fault.watchdog_timeout_s < max(cfg.comm.init_timeout_s, cfg.comm.collective_timeout_s)
    assert timeout_warnings(cfg, 8) == []
    assert timeout_warnings(config(device="cuda"), 8) == []


def test_a_watchdog_at_or_above_the_collective_timeout_is_announced():
    assert timeout_warnings(config(comm={"collective_timeout_s": 600}), 2) == [WATCHDOG_LINE]
    equal = timeout_warnings(config(comm={"collective_timeout_s": 900}), 2)
    assert equal and equal[0].startswith("lmforge: warning: fault.watchdog_timeout_s=900 is not below comm.collective")
    # control: one second below the collective timeout is in order
    assert timeout_warnings(config(comm={"collective_timeout_s": 901}), 2) == []


def test_the_init_timeout_is_named_when_it_sets_the_group_timeout():
    cfg = config(comm={"collective_timeout_s": 300, "init_timeout_s": 1000}, fault={"watchdog_timeout_s": 1000})
    assert timeout_warnings(cfg, 4) == [
        "lmforge: warning: fault.watchdog_timeout_s=1000 is not below the process-group timeout 1000 s "
        "(comm.init_timeout_s=1000, the larger of comm.init_timeout_s and comm.collective_timeout_s): a hung "
        "collective ends the processes after 1000 s, before the watchdog writes their stacks to <run>/dumps; set "
        "fault.watchdog_timeout_s below 1000 (e.g. fault.watchdog_timeout_s=750) or comm.collective_timeout_s above "
        "1000 (e.g. comm.collective_timeout_s=1380)"
    ]


@pytest.mark.parametrize(
    "why, cfg, world",
    [
        ("one process has no collective to hang in", config(comm={"collective_timeout_s": 600}), 1),
        ("the world is not known", config(comm={"collective_timeout_s": 600}), None),
        ("the watchdog is off", config(comm={"collective_timeout_s": 600}, fault={"watchdog_timeout_s": 0}), 2),
        (
            "NCCL without async error handling hangs on: the watchdog still ends it",
            config(comm={"collective_timeout_s": 600, "async_error_handling": False, "backend": "nccl"}),
            2,
        ),
    ],
)
def test_no_watchdog_line_where_the_collective_timeout_cannot_end_a_hang_first(why, cfg, world):
    assert timeout_warnings(cfg, world) == [], why


def test_gloo_ends_a_hung_collective_even_without_async_error_handling():
    cfg = config(comm={"collective_timeout_s": 600, "async_error_handling": False})  # auto on the CPU: gloo
    assert timeout_warnings(cfg, 2) == [WATCHDOG_LINE]


SAVE = MeasuredSave(step=2000, seconds=150.4, source="runs/r/metrics.jsonl")


def test_a_save_longer_than_the_signal_lead_is_announced_under_slurm():
    assert timeout_warnings(RootConfig(), 2, SAVE, under_slurm=True) == [
        "lmforge: warning: cluster.signal_lead_s=120 is not longer than this run's newest checkpoint save (150 s at "
        "step 2000, runs/r/metrics.jsonl): at the time limit Slurm may kill the job before its preemption checkpoint "
        "is committed; set cluster.signal_lead_s above 150 (e.g. cluster.signal_lead_s=240; with sbatch "
        "slurm/train.sh also sbatch --signal=B:USR1@240)"
    ]
    assert timeout_warnings(RootConfig(), 2, SAVE, under_slurm=False) == []  # no Slurm: no time-limit signal
    # control: a lead longer than the save, and no measured save at all
    assert timeout_warnings(config(cluster={"signal_lead_s": 151}), 2, SAVE, under_slurm=True) == []
    assert timeout_warnings(RootConfig(), 2, None, under_slurm=True) == []


def test_a_save_longer_than_the_watchdog_is_announced():
    long_save = MeasuredSave(step=40, seconds=1000.0, source="m.jsonl")
    assert timeout_warnings(RootConfig(), 1, long_save) == [
        "lmforge: warning: fault.watchdog_timeout_s=900 is not longer than this run's newest checkpoint save (1000 s "
        "at step 40, m.jsonl): no heartbeat is beaten during a blocking save, so the watchdog ends it as a hang "
        "(exit 43) before it is committed; set fault.watchdog_timeout_s above 1000 (e.g. fault.watchdog_timeout_s=1380) "
        "and comm.collective_timeout_s above it (e.g. comm.collective_timeout_s=1860)"
    ]
    short = config(fault={"watchdog_timeout_s": 300})
    assert timeout_warnings(short, 1, replace(SAVE, seconds=400.0)) == [
        "lmforge: warning: fault.watchdog_timeout_s=300 is not longer than this run's newest checkpoint save (400 s "
        "at step 2000, runs/r/metrics.jsonl): no heartbeat is beaten during a blocking save, so the watchdog ends it "
        "as a hang (exit 43) before it is committed; set fault.watchdog_timeout_s above 400 "
        "(e.g. fault.watchdog_timeout_s=540)"
    ]
    assert timeout_warnings(RootConfig(), 1, SAVE) == []  # control: 150 s fits the default 900 s


def write_events(path: Path, events: list) -> None:
    logger = MetricsLogger([JsonlSink(path)], rank=0)
    for name, fields in events:
        logger.event(name, **fields)
    logger.close()


def test_the_newest_committed_save_is_read_back_from_the_end(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_events(
        metrics,
        [
            ("checkpoint_save", {"step": 10, "stall_s": 30.0, "async_mode": "none", "path": "c10"}),
            ("checkpoint_commit", {"step": 10, "write_s": 31.0, "path": "c10"}),
            ("checkpoint_save", {"step": 20, "stall_s": 2.0, "async_mode": "thread", "path": "c20"}),
            ("checkpoint_commit", {"step": 20, "write_s": 40.0, "path": "c20"}),
            ("checkpoint_save", {"step": 30, "stall_s": 2.5, "async_mode": "thread", "path": "c30"}),  # never committed
        ],
    )
    with open(metrics, "a") as f:
        f.write('{"kind": "train", "step": 31, "loss"')  # a killed run's torn last line
    assert newest_save(metrics) == MeasuredSave(20, 42.0, str(metrics))  # async: staging + write
    # Read in blocks from the end: a block smaller than one line gives the same lines.
    lines = list(lines_from_end(metrics, block=7))
    assert lines == [ln for ln in reversed(metrics.read_text().splitlines()) if ln.strip()]
    sync = tmp_path / "sync.jsonl"
    write_events(sync, [("checkpoint_save", {"step": 5, "stall_s": 30.0, "async_mode": "none", "path": "c5"})])
    assert newest_save(sync) is None  # control: no commit, no measured save
    write_events(sync, [("checkpoint_commit", {"step": 5, "write_s": 31.0, "path": "c5"})])
    assert newest_save(sync) == MeasuredSave(5, 31.0, str(sync))  # sync: the commit's time covers the whole save
    assert newest_save(tmp_path / "absent.jsonl") is None


def test_a_resumed_run_is_checked_against_its_newest_save(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    write_events(
        tmp_path / "metrics.jsonl",
        [
            ("checkpoint_save", {"step": 2000, "stall_s": 150.4, "async_mode": "none", "path": "c"}),
            ("checkpoint_commit", {"step": 2000, "write_s": 150.4, "path": "c"}),
        ],
    )
    resumed = EntryChecks(None, None, tmp_path, ResumePoint(tmp_path / "checkpoints" / "step_00002000", {}), None)
    lines = timeout_lines(RootConfig(), 2, resumed)
    assert len(lines) == 1 and lines[0].startswith(
        f"lmforge: warning: cluster.signal_lead_s=120 is not longer than this run's newest checkpoint save (150 s at "
        f"step 2000, {tmp_path / 'metrics.jsonl'}):"
    )
    fresh = replace(resumed, resume_point=None)
    assert timeout_lines(RootConfig(), 2, fresh) == []  # control: a fresh start is not judged by old saves


def test_the_start_checks_print_the_warning_once_on_stderr(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    overrides = ["model=tiny", "parallelism=ddp", "parallelism.dp_replicate=2", "train.micro_batch_size=4"]
    short = compose(overrides + ["train.device=cpu", "comm.collective_timeout_s=600"])
    check_start(short, world_size=2, epochs=False)
    out = capsys.readouterr()
    assert out.err.splitlines() == [WATCHDOG_LINE] and WATCHDOG_LINE not in out.out
    monkeypatch.setenv("RANK", "1")  # another rank of the same launch says nothing
    check_start(short, world_size=2, epochs=False)
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")
    check_start(compose(overrides + ["train.device=cpu"]), world_size=2, epochs=False)  # control: the defaults
    assert capsys.readouterr().err == ""

"""Verdicts through real torchrun (``lmforge launch --nproc 2``, lmforge.launch.agent): a deterministic failure
is not restarted, its exit code survives the agent, a crash that recurs at the same step stops the run, and a
peer SIGKILLed at the same step twice (the survivor's gloo error is a lost peer) does not.

Each case is one ``lmforge launch`` of a tiny 2-rank DDP run (a few steps); the checks of a case share it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

pytestmark = pytest.mark.distributed

BASE = [
    "model=tiny",
    "parallelism=ddp",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.threads=1",
    "train.device=cpu",
    "train.eval_every=0",
    "logging.console=plain",
    "logging.every_steps=1",
]


def launch(tmp_path: Path, name: str, overrides: List[str], data_cache: Path, timeout: int = 280):
    cmd = [
        sys.executable,
        "-m",
        "lmforge.cli",
        "launch",
        "--nproc",
        "2",
        *BASE,
        f"run.root={tmp_path}",
        f"run.name={name}",
        *overrides,
    ]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        # OMP_NUM_THREADS is the launcher's to set (an inherited value would hide torchrun's banner)
        env={**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "LMFORGE_DATA_CACHE": str(data_cache)},
    )
    return proc, tmp_path / name


def verdicts(run: Path) -> dict:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (run / "verdicts").glob("rank*.json")}


def events(run: Path, name: str) -> List[dict]:
    recs = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in recs if r.get("kind") == "event" and r["event"] == name]


def why(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-2500:]}\n--- stderr ---\n{proc.stderr[-5000:]}"


@pytest.mark.timeout(300)
def test_config_error_at_worker_start_is_not_restarted_and_keeps_exit_2(tmp_path, data_cache):
    # A resume target that does not exist: `lmforge launch` validates the config fine (validate() reads no
    # checkpoint), each worker refuses it when it resolves the checkpoint. train.threads=0 (the default): the
    # launcher exports OMP_NUM_THREADS (CPUs / 2), so torchrun prints no banner of its own.
    missing = tmp_path / "nothing"
    proc, run = launch(
        tmp_path,
        "cfg",
        [
            f"train.resume={missing}",
            "train.max_steps=4",
            "fault.max_restarts=3",
            "cluster.max_requeues=3",
            "train.threads=0",
        ],
        data_cache,
    )
    assert proc.returncode == 2, why(proc)
    assert "OMP_NUM_THREADS" not in proc.stdout + proc.stderr, why(proc)
    v = verdicts(run)
    assert set(v) <= {0, 1} and v, why(proc)
    for rank, verdict in v.items():
        assert verdict["kind"] == "config_error" and verdict["deterministic"] and verdict["exit_code"] == 2
        assert verdict["rank"] == rank and verdict["step"] == 0 and verdict["torchrun_restart"] == 0
        assert verdict["message"].startswith(f"config key 'train.resume': {missing} does not exist")
    assert "lmforge agent: not restarting the worker group (3 restarts left): config_error on rank" in proc.stderr
    assert "lmforge launch: stop: config_error on rank" in proc.stderr
    state = json.loads((run / "requeues.json").read_text())
    assert [h["action"] for h in state["history"]] == ["stop"] and state["failures"] == 0, state
    assert state["history"][0]["kind"] == "config_error"
    assert not events(run, "restart")  # one run: the group was never restarted


@pytest.mark.timeout(300)
def test_divergence_under_torchrun_runs_once_with_its_verdict(tmp_path, data_cache):
    proc, run = launch(
        tmp_path,
        "div",
        [
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "train.max_steps=20",
            "fault.max_consecutive_skips=2",
            "checkpoint.every_steps=0",
            "fault.max_restarts=2",
            "cluster.max_requeues=2",
        ],
        data_cache,
    )
    assert proc.returncode == 45, why(proc)
    v = verdicts(run)
    assert v, why(proc)
    first = min(v.values(), key=lambda x: x["time"])
    assert first["kind"] == "diverged" and first["exit_code"] == 45 and first["deterministic"]
    skipped = events(run, "skipped_step")
    assert first["step"] == skipped[-1]["step"] and first["step"] >= 2, (first, skipped)
    assert first["message"].startswith("training diverged: 2 skipped steps in a row since step")
    assert not events(run, "restart") and not (run / "DONE").exists()
    state = json.loads((run / "requeues.json").read_text())
    assert [(h["action"], h["kind"], h["exit_code"]) for h in state["history"]] == [("stop", "diverged", 45)]


@pytest.mark.timeout(300)
def test_crash_recurring_at_the_same_step_stops_after_the_second_with_both_tracebacks(tmp_path, data_cache):
    # Rank 1 raises after step 3 on every attempt; torchrun restarts once (resume from step 2), the crash
    # recurs at step 3: a repeated crash, deterministic, although 2 restarts and 2 requeues are left.
    proc, run = launch(
        tmp_path,
        "rep",
        [
            "train.max_steps=6",
            "checkpoint.every_steps=2",
            "fault.drill.crash_step=3",
            "fault.drill.crash_rank=1",
            "fault.drill.crash_times=0",
            "fault.max_restarts=3",
            "cluster.max_requeues=2",
        ],
        data_cache,
    )
    assert proc.returncode == 46, why(proc)
    v = verdicts(run)[1]
    assert v["kind"] == "repeated_crash" and v["rank"] == 1 and v["step"] == 3 and v["exit_code"] == 46
    assert v["torchrun_restart"] == 1, v
    first, second = (Path(p) for p in v["tracebacks"])
    for tb in (first, second):
        text = tb.read_text()
        assert tb.parent == run / "crashes" and tb.name.startswith("step-00000003-DrillCrash-rank1-"), tb
        assert "DrillCrash: drill: crash on rank 1 after step 3" in text and "Traceback" in text
    assert "torchrun restart 0" in first.read_text().splitlines()[0]
    assert "torchrun restart 1" in second.read_text().splitlines()[0]
    assert "not restarting the worker group (2 restarts left): repeated_crash on rank 1 at step 3" in proc.stderr
    assert "resumed from step 2" in proc.stdout + proc.stderr
    state = json.loads((run / "requeues.json").read_text())
    assert [(h["action"], h["kind"]) for h in state["history"]] == [("stop", "repeated_crash")], state


@pytest.mark.timeout(480)
def test_peer_killed_twice_at_one_step_and_a_crash_once_are_retried_and_the_run_completes(tmp_path, data_cache):
    # Rank 1 is SIGKILLed after step 3 in the first two attempts (torchrun restarts them): rank 0 dies in its
    # step-3 collective both times with the same gloo error, a lost peer, which never makes a repeated crash.
    # Negative control: the crash drill once (third attempt, torchrun's restarts spent), the launcher's retry
    # relaunches it (a retryable 'crash' verdict), the relaunch resumes from step 2 and finishes.
    proc, run = launch(
        tmp_path,
        "once",
        [
            "train.max_steps=6",
            "checkpoint.every_steps=2",
            "fault.drill.kill_step=3",
            "fault.drill.kill_rank=1",
            "fault.drill.kill_times=2",
            "fault.drill.crash_step=3",
            "fault.drill.crash_rank=1",
            "fault.drill.crash_times=1",
            "fault.max_restarts=2",
            "cluster.max_requeues=1",
        ],
        data_cache,
        timeout=450,
    )
    assert proc.returncode == 0, why(proc)
    assert (run / "DONE").exists()
    assert sorted(p.name for p in (run / "drills").iterdir()) == ["crash-0", "kill", "kill-1"]
    assert "repeated_crash" not in proc.stdout + proc.stderr and "not restarting" not in proc.stderr, why(proc)
    state = json.loads((run / "requeues.json").read_text())
    assert [(h["action"], h["kind"]) for h in state["history"]] == [("requeue", "failure"), ("done", "done")], state
    crashed = state["history"][0]["verdicts"]
    assert any(x["kind"] == "crash" and x["rank"] == 1 and x["step"] == 3 for x in crashed), crashed
    assert not any(x["deterministic"] for x in crashed), crashed
    history = [json.loads(line) for line in (run / "verdicts" / "history.jsonl").read_text().splitlines()]
    assert any(h["kind"] == "crash" and h["rank"] == 1 for h in history)  # archived when the relaunch started
    assert not verdicts(run)  # the successful attempt left none
    assert len(list((run / "crashes").glob("step-00000003-DrillCrash-rank1-*.txt"))) == 1
    # rank 0's lost-peer errors: kept, one per attempt that lost rank 1 at step 3, none counted as a crash
    lost = sorted((run / "crashes").glob("step-00000003-*-peer_lost-rank0-*.txt"))
    assert len(lost) >= 2, sorted(p.name for p in (run / "crashes").iterdir())
    for tb in lost:
        assert "by peer" in tb.read_text() and "Traceback" in tb.read_text(), tb.read_text()[-2000:]
    assert all("-peer_lost-" in p.name for p in (run / "crashes").glob("*-rank0-*.txt"))
    assert "resumed from step 2" in proc.stdout + proc.stderr

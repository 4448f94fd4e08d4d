"""Goodput of a run that meets a slow save, a SIGKILL, a preemption and a hang (fault/goodput.py), on real
processes: each launch's ledger and the accounting give the split the injected faults should.

Four launches of one run directory (tiny model, 16 steps, a checkpoint every 3):

1. one process; its step-3 save sleeps 2 s (tests/drills/slow_save_train.py); SIGKILL after step 5
   (``fault.drill.kill_step``): its ledger ends at step 4 (the kill comes before step 5's line), and the next
   launch, resuming from step 3, redoes step 4;
2. one process, resumed from step 3, preempted (SIGTERM from this test once step 6 is in its ledger): it saves the
   step it stops at and ends with ``Preempted``; nothing is redone;
3. two ranks under torchrun (launchers/torchrun_local.sh), after this test waited 1.5 s: rank 1 withholds its
   collective after step 13 (``fault.drill.hang_*``), rank 0's watchdog fires 3 s later, torchrun restarts the
   group, which resumes from step 12 (step 13 redone) and completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLOW_SAVE = Path(__file__).resolve().parent / "slow_save_train.py"
LOCAL = REPO / "launchers" / "torchrun_local.sh"
SAVE_SLEEP_S, WATCHDOG_S, WAIT_S = 2.0, 3.0, 1.5
RUN = [
    "model=tiny",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.threads=1",
    "train.device=cpu",
    "train.eval_every=0",
    "train.max_steps=16",
    "checkpoint.every_steps=3",
    "logging.console=plain",
    "logging.every_steps=1",
    "logging.wandb.mode=disabled",
]


def env(data_cache: Path) -> dict:
    path = os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "LMFORGE_PYTHON": sys.executable, "PYTHONPATH": path, "LMFORGE_DATA_CACHE": str(data_cache)}


def ledger_steps(run: Path, launch: int) -> list:
    path = run / "goodput" / f"launch-{launch:03d}.jsonl"
    if not path.exists():
        return []
    return [r["s"] for r in map(json.loads, path.read_text().splitlines()[:-1] or ["{}"]) if "s" in r]


def out(proc) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(900)
def test_goodput_splits_a_slow_save_a_kill_a_preemption_and_a_hang(tmp_path, data_cache):
    where = [f"run.root={tmp_path}", "run.name=drill"]
    run = tmp_path / "drill"
    e = env(data_cache)
    first = subprocess.run(
        [sys.executable, str(SLOW_SAVE), "3", str(SAVE_SLEEP_S), *RUN, *where, "fault.drill.kill_step=5"],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == -signal.SIGKILL, out(first)

    second = subprocess.Popen(
        [sys.executable, "-m", "lmforge.train", *RUN, *where, "fault.drill.step_sleep_s=0.4"],
        cwd=tmp_path,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while max(ledger_steps(run, 1), default=0) < 6 and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        second.send_signal(signal.SIGTERM)
        stdout, stderr = second.communicate(timeout=120)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    preempted = subprocess.CompletedProcess(second.args, second.returncode, stdout, stderr)
    assert "preemption_checkpoint" in stdout, out(preempted)

    time.sleep(WAIT_S)
    hang = [
        "fault.drill.hang_step=13",
        "fault.drill.hang_rank=1",
        "fault.drill.hang_s=120",
        f"fault.watchdog_timeout_s={WATCHDOG_S}",
        "fault.watchdog_poll_s=0.2",
        "parallelism=ddp",
    ]
    third = subprocess.run(
        ["bash", str(LOCAL), "--nproc", "2", "--max-restarts", "1", "--", *RUN, *where, *hang],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert third.returncode == 0 and (run / "DONE").exists(), out(third)

    report = json.loads((run / "goodput.json").read_text())
    launches = report["per_launch"]
    assert [x["ended"] for x in launches] == ["killed (no end record)", "Preempted", "killed (no end record)", "done"]
    stopped_at = launches[1]["last_step"]
    assert 6 <= stopped_at < 12 and launches[2]["start_step"] == stopped_at, launches
    assert [x["start_step"] for x in launches] == [0, 3, stopped_at, 12]
    assert [x["redone_steps"] for x in launches] == [1, 0, 1, 0]  # step 4 of the first, the stuck step 13 of the third
    assert (report["committed_steps"], report["redone_steps"]) == (16, 2)
    sec = report["seconds"]
    assert sum(sec.values()) == pytest.approx(report["wall_s"], rel=1e-9)
    # the injected durations, each where it belongs
    first_saves = launches[0]["seconds"]["checkpoint_save"]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    commit_3 = next(r for r in events if r.get("event") == "checkpoint_commit" and r["step"] == 3)
    # the one (slowed) save of the first launch: as long as the save itself measured (a synchronous save's
    # commit event times the whole save), the injected sleep included
    assert SAVE_SLEEP_S <= first_saves == pytest.approx(commit_3["write_s"], abs=0.5), (launches[0], commit_3)
    assert WATCHDOG_S <= sec["hung"] <= WATCHDOG_S + 2.0, sec
    assert sec["hung"] == launches[2]["seconds"]["hung"], launches
    assert launches[1]["seconds"]["restart_wait"] >= WAIT_S, launches  # this test's pause before the third launch
    assert min(x["seconds"]["startup"] for x in launches) > 0 and sec["checkpoint_load"] > 0
    # committed tokens / (the full-membership rate x wall): 16 steps at the median kept step time
    assert report["goodput"] == pytest.approx(16 * report["full_membership_step_s"] / report["wall_s"])
    assert 0 < report["goodput"] < 1
    table = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "goodput", str(run)], env=e, capture_output=True, text=True, timeout=120
    )
    assert table.returncode == 0 and "4 launch(es), 16 steps kept, 2 redone" in table.stdout, out(table)

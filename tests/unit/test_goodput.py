"""Goodput accounting (fault/goodput.py) over launch ledgers with known times: each cause gets what it should,
the causes sum to the wall time, and a run without a restart has nothing redone or lost between launches."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lmforge.fault.goodput import CAUSES, GoodputError, account, format_report, read_ledger, run_dirs, write_goodput
from lmforge.fault.goodput_cli import main as goodput_main
from lmforge.fault.goodput_ledger import GoodputLedger, process_start_time


def write_ledger(run: Path, launch: int, start: dict, steps: list, end: dict | None) -> None:
    lines = [{"kind": "start", "launch": launch, "tokens_per_step": 100, "world_size": 2, **start}, *steps]
    if end is not None:
        lines.append({"kind": "end", **end})
    (run / "goodput").mkdir(parents=True, exist_ok=True)
    (run / "goodput" / f"launch-{launch:03d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def steps(first: int, last: int, t0: float, extra: dict | None = None) -> list:
    """Steps first..last of 1 s each, ending at t0+1, t0+2, ...; ``extra``: fields of a given step."""
    return [
        {"s": s, "t": t0 + (s - first + 1), "d": 1.0, "w": 0.0, **(extra or {}).get(s, {})}
        for s in range(first, last + 1)
    ]


def killed_then_resumed(run: Path, resume_from: int) -> None:
    """Launch 0: start-up 10 s, steps 1-7 (a 0.5 s save stall in step 4), killed after step 7 (t=117); the hang
    watchdog fires at t=130. Launch 1 starts at t=140: start-up 8 s + a 2 s load, steps resume_from+1..10, a 1 s
    final save."""
    write_ledger(
        run,
        0,
        {"process_start": 100.0, "loop_start": 110.0, "start_step": 0, "load_s": 0.0},
        steps(1, 7, 110.0, {4: {"c": 0.5}}),
        None,
    )
    (run / "metrics.jsonl").write_text(
        json.dumps({"kind": "event", "event": "watchdog", "time": 130.0, "step": 7, "rank": 1})
        + "\n"
        + json.dumps({"kind": "train", "time": 117.0, "step": 7})
        + "\n"
    )
    n = 10 - resume_from
    write_ledger(
        run,
        1,
        {"process_start": 140.0, "loop_start": 150.0, "start_step": resume_from, "load_s": 2.0},
        steps(resume_from + 1, 10, 150.0),
        {"t": 150.0 + n + 1.0, "step": 10, "reason": "done", "final_save_s": 1.0},
    )


def test_a_restart_from_an_older_checkpoint_books_redone_hung_and_restart_wait(tmp_path):
    killed_then_resumed(tmp_path, resume_from=4)
    r = account(tmp_path)
    sec = r["seconds"]
    assert sec["productive"] == pytest.approx(3.5 + 6.0)  # steps 1-4 (less the stall) and 5-10 of launch 1
    assert sec["redone"] == pytest.approx(3.0)  # steps 5-7 of launch 0, run again by launch 1
    assert sec["startup"] == pytest.approx(10.0 + 8.0) and sec["checkpoint_load"] == pytest.approx(2.0)
    assert sec["checkpoint_save"] == pytest.approx(0.5 + 1.0)
    assert sec["hung"] == pytest.approx(13.0) and sec["restart_wait"] == pytest.approx(10.0)
    assert sec["other"] == pytest.approx(0.0, abs=1e-9)
    assert r["wall_s"] == pytest.approx(57.0) and sum(sec.values()) == pytest.approx(r["wall_s"])
    assert (r["launches"], r["committed_steps"], r["redone_steps"]) == (2, 10, 3)
    assert r["full_membership_step_s"] == pytest.approx(1.0)
    assert r["goodput"] == pytest.approx(1000 / (100 * 57.0))
    assert [x["ended"] for x in r["per_launch"]] == ["killed (no end record)", "done"]


def test_negative_control_resuming_from_the_last_step_redoes_nothing(tmp_path):
    killed_then_resumed(tmp_path, resume_from=7)
    r = account(tmp_path)
    assert r["redone_steps"] == 0 and r["seconds"]["redone"] == 0.0
    assert r["seconds"]["productive"] == pytest.approx(6.5 + 3.0)
    assert sum(r["seconds"].values()) == pytest.approx(r["wall_s"])


def test_the_step_an_exception_interrupted_is_redone_when_a_later_launch_runs_it_again(tmp_path):
    write_ledger(
        tmp_path,
        0,
        {"process_start": 0.0, "loop_start": 5.0, "start_step": 0, "load_s": 0.0},
        steps(1, 2, 5.0),
        {"t": 8.5, "step": 3, "reason": "RuntimeError", "final_save_s": 0.0},
    )
    write_ledger(
        tmp_path,
        1,
        {"process_start": 10.0, "loop_start": 12.0, "start_step": 2, "load_s": 0.5},
        steps(3, 4, 12.0),
        {"t": 14.0, "step": 4, "reason": "done", "final_save_s": 0.0},
    )
    r = account(tmp_path)
    assert (r["redone_steps"], r["seconds"]["redone"]) == (1, pytest.approx(1.5))  # step 3's 1.5 s before the error
    assert r["seconds"]["restart_wait"] == pytest.approx(1.5) and r["seconds"]["other"] == pytest.approx(0.0)
    assert sum(r["seconds"].values()) == pytest.approx(r["wall_s"]) == 14.0
    assert [x["last_step"] for x in r["per_launch"]] == [2, 4] and r["committed_steps"] == 4


def test_a_hang_books_the_watchdogs_idle_time_and_the_step_it_interrupted(tmp_path):
    killed_then_resumed(tmp_path, resume_from=4)
    hang = {"kind": "event", "event": "watchdog", "time": 130.0, "step": 8, "rank": 0, "idle_s": 3.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(hang) + "\n")
    r = account(tmp_path)
    sec = r["seconds"]
    assert sec["hung"] == pytest.approx(3.0)  # the last heartbeat (after step 8's work) to the firing
    assert sec["redone"] == pytest.approx(3.0 + 10.0) and r["redone_steps"] == 4  # steps 5-7 and the stuck step 8
    assert sec["restart_wait"] == pytest.approx(10.0) and sec["other"] == pytest.approx(0.0, abs=1e-9)
    assert sum(sec.values()) == pytest.approx(r["wall_s"]) == 57.0


def test_one_clean_launch_splits_evaluation_data_wait_and_profiled_steps(tmp_path):
    extra = {2: {"w": 0.25}, 3: {"e": 0.5}, 4: {"p": 1}}
    write_ledger(
        tmp_path,
        0,
        {"process_start": 0.0, "loop_start": 5.0, "start_step": 0, "load_s": 0.0},
        steps(1, 4, 5.0, extra),
        {"t": 9.5, "step": 4, "reason": "done", "final_save_s": 0.25},
    )
    r = account(tmp_path)
    sec = r["seconds"]
    assert (sec["data_wait"], sec["evaluation"], sec["profiled"]) == (0.25, 0.5, 1.0)
    assert sec["productive"] == pytest.approx(1.0 + 0.75 + 0.5)
    assert sec["other"] == pytest.approx(0.25)  # the end record came 0.5 s after step 4, 0.25 s of it the final save
    assert sec["restart_wait"] == sec["hung"] == sec["redone"] == 0.0
    assert sum(sec.values()) == pytest.approx(r["wall_s"]) == 9.5
    table = format_report(r)
    assert table.splitlines()[0] == f"goodput {r['goodput']:.3f}  {tmp_path}"
    assert [line.split()[0] for line in table.splitlines()[2:]] == list(CAUSES)


def test_the_ledger_writes_what_the_accounting_reads_and_a_torn_line_is_ignored(tmp_path):
    ledger = GoodputLedger(tmp_path / "goodput", launch=0)
    ledger.start(start_step=0, load_s=0.0, tokens_per_step=64, world_size=1)
    ledger.add_eval(0.125)
    ledger.step(1, 0.5, 0.01)
    ledger.add_save(0.25)
    ledger.step(2, 0.5, 0.0, profiled=True)
    ledger.close()  # killed: no end record
    path = tmp_path / "goodput" / "launch-000.jsonl"
    with path.open("a") as fh:
        fh.write('{"s": 3, "t": 1')  # the process died writing this line
    launch = read_ledger(path)
    assert launch.end is None and [s["s"] for s in launch.steps] == [1, 2]
    assert launch.steps[0]["e"] == 0.125 and "c" not in launch.steps[0]
    assert launch.steps[1]["c"] == 0.25 and launch.steps[1]["p"] == 1 and "e" not in launch.steps[1]
    assert launch.start["process_start"] <= launch.start["loop_start"]
    report = write_goodput(tmp_path)
    assert json.loads((tmp_path / "goodput.json").read_text()) == json.loads(json.dumps(report))
    off = GoodputLedger(tmp_path / "other", launch=0, enabled=False)  # ranks other than 0 write nothing
    off.start(start_step=0, load_s=0.0, tokens_per_step=64, world_size=1)
    off.step(1, 0.5, 0.0)
    off.end(1, "done")
    assert not (tmp_path / "other").exists()


def test_a_directory_of_runs_is_accounted_per_run_and_nothing_to_account_exits_2(tmp_path, capsys):
    for name in ("p1", "p2"):
        write_ledger(
            tmp_path / "sweep" / name,
            0,
            {"process_start": 0.0, "loop_start": 1.0, "start_step": 0},
            steps(1, 2, 1.0),
            {"t": 3.0, "step": 2, "reason": "done"},
        )
    assert run_dirs(tmp_path / "sweep") == [tmp_path / "sweep" / "p1", tmp_path / "sweep" / "p2"]
    assert goodput_main([str(tmp_path / "sweep")]) == 0
    assert capsys.readouterr().out.count("goodput ") == 2
    with pytest.raises(GoodputError, match="no goodput ledger"):
        account(tmp_path / "sweep")
    (tmp_path / "empty").mkdir()
    assert goodput_main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run below it has a goodput ledger" in err[0] and "Fix:" in err[0]
    assert goodput_main([str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_a_process_start_is_placed_between_its_fork_and_its_first_line_to_the_clock_tick():
    # a restarted launch must start after the watchdog firing that caused it; /proc/stat's whole-second btime
    # placed it up to 1 s early (the negative control: the lower bound fails with btime on most boots)
    read_end, write_end = os.pipe()
    before = time.time()
    pid = os.fork()
    if pid == 0:  # the child: its first line, then its start as the ledger computes it
        first_line = time.time()
        os.write(write_end, f"{first_line} {process_start_time()}".encode())
        os._exit(0)
    os.close(write_end)
    first_line, start = map(float, os.read(read_end, 200).decode().split())
    os.close(read_end)
    os.waitpid(pid, 0)
    tick = 0.011  # SC_CLK_TCK is 100 on Linux: a start is truncated to 10 ms
    assert before - tick <= start <= first_line, (before, start, first_line)


def test_a_batch_ramp_counts_each_kept_steps_tokens_and_rates_them_at_their_own_size(tmp_path):
    # steps 1-2 at 25 tokens (0.25 s), 3-4 at 50 (0.5 s), 5-6 full (100, 1 s): one rate, 100 tokens/s; launch 0 is
    # killed after step 5 and launch 1 resumes from step 4, so step 5 is redone and counted once
    ramp = {1: {"n": 25, "d": 0.25}, 2: {"n": 25, "d": 0.25}, 3: {"n": 50, "d": 0.5}, 4: {"n": 50, "d": 0.5}}
    write_ledger(
        tmp_path,
        0,
        {"process_start": 0.0, "loop_start": 1.0, "start_step": 0, "load_s": 0.0},
        steps(1, 5, 1.0, ramp),
        None,
    )
    write_ledger(
        tmp_path,
        1,
        {"process_start": 10.0, "loop_start": 11.0, "start_step": 4, "load_s": 0.0},
        steps(5, 6, 11.0),
        {"t": 13.0, "step": 6, "reason": "done"},
    )
    r = account(tmp_path)
    assert r["committed_tokens"] == 25 + 25 + 50 + 50 + 100 + 100 and r["redone_steps"] == 1
    assert r["full_membership_tokens_per_s"] == pytest.approx(100.0)
    assert r["goodput"] == pytest.approx(350 / (100.0 * r["wall_s"]))
    # Negative control: the ledger without the ramp's sizes books six full steps.
    for path in (tmp_path / "goodput").glob("*.jsonl"):
        path.write_text(
            "".join(
                line.replace(', "n": 25', "").replace(', "n": 50', "") + "\n" for line in path.read_text().splitlines()
            )
        )
    assert account(tmp_path)["committed_tokens"] == 600


def test_a_later_run_in_the_same_process_starts_when_it_begins(tmp_path, monkeypatch):
    """A sweep worker trains its points one after another in one process: the first run's start-up counts from the
    process's start (its imports), a later run's from its own begin_run, so its start line does not charge it the
    runs before it."""
    from lmforge.fault import goodput_ledger

    monkeypatch.setattr(goodput_ledger, "_RUNS_BEGUN", 0)
    monkeypatch.setattr(goodput_ledger, "_RUN_START", None)
    goodput_ledger.begin_run()
    assert goodput_ledger.run_start_time() == pytest.approx(process_start_time(), abs=0.01)
    before = time.time()
    goodput_ledger.begin_run()
    second = goodput_ledger.run_start_time()
    assert before <= second <= time.time() and second > process_start_time()
    ledger = GoodputLedger(tmp_path / "goodput", launch=1)
    ledger.start(start_step=0, load_s=0.0, tokens_per_step=100, world_size=1)
    ledger.close()
    start = json.loads((tmp_path / "goodput" / "launch-001.jsonl").read_text().splitlines()[0])
    assert start["process_start"] == second

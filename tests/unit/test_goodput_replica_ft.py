"""Goodput under replica fault tolerance (fault/goodput.py, fault/goodput_job.py) on ledgers with known times: a
step no group committed is redone, the steps a heal skipped are not the group's, steps committed by fewer groups
are booked reduced_membership with their tokens kept, and a job's groups sum to replica-seconds on the scale of a
whole-job run. Each case has a control the rule must change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.fault.goodput import CAUSES, account, format_report, read_ledger
from lmforge.fault.goodput_cli import main as goodput_main
from lmforge.fault.goodput_job import account_job, group_dirs
from lmforge.fault.goodput_ledger import GoodputLedger

TOKENS = 100  # a group's tokens per step


def write_ledger(run: Path, launch: int, start: dict, lines: list, end: dict | None) -> None:
    head = {"kind": "start", "launch": launch, "tokens_per_step": TOKENS, "world_size": 1, "load_s": 0.0, **start}
    body = [head, *lines, *([{"kind": "end", **end}] if end else [])]
    (run / "goodput").mkdir(parents=True, exist_ok=True)
    (run / "goodput" / f"launch-{launch:03d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in body))


def timed(lines: list, t0: float) -> list:
    """Step lines with their end times: each starts where the one before ended (``d`` seconds, 1 s if absent)."""
    out, t = [], t0
    for line in lines:
        d = line.get("d", 1.0)
        t += d
        out.append({"w": 0.0, **line, "d": d, "t": t})
    return out


def one_launch(run: Path, lines: list, replicas: int = 3) -> dict:
    start = {"process_start": 0.0, "loop_start": 2.0, "start_step": 0, **({"replicas": replicas} if replicas else {})}
    body = timed(lines, 2.0)
    write_ledger(run, 0, start, body, {"t": body[-1]["t"], "step": body[-1]["s"], "reason": "done"})
    return account(run)


def test_a_step_no_group_committed_is_booked_redone_and_not_committed(tmp_path):
    # step 3 failed on every group (a peer died in its all-reduce) and was run again with the next quorum
    lines = [{"s": 1}, {"s": 2}, {"s": 3, "u": 1}, {"s": 3}, {"s": 4}]
    r = one_launch(tmp_path / "ft", lines)
    assert r["seconds"]["redone"] == pytest.approx(1.0) and r["redone_steps"] == 1
    assert r["seconds"]["productive"] == pytest.approx(4.0)
    assert (r["committed_steps"], r["committed_tokens"]) == (4, 4 * TOKENS)
    assert sum(r["seconds"].values()) == pytest.approx(r["wall_s"]) == pytest.approx(7.0)
    # control: the same ledger without the mark books the failed attempt as productive work
    r = one_launch(tmp_path / "control", [{k: v for k, v in x.items() if k != "u"} for x in lines])
    assert r["seconds"]["redone"] == 0.0 and r["seconds"]["productive"] == pytest.approx(5.0)


def healed_group(run: Path, heal: bool) -> dict:
    """Launch 0 commits steps 1-5 and is SIGKILLed (t=8); launch 1 starts at t=10 from no checkpoint. ``heal``: its
    first quorum heals it from a peer at step 11 (2 s of the step), and it commits 12-20; else it runs 1-20 itself."""
    write_ledger(
        run,
        0,
        {"process_start": 0.0, "loop_start": 2.0, "start_step": 0, "replicas": 2},
        timed([{"s": s} for s in range(1, 6)], 2.0),
        None,
    )
    if heal:
        lines = [{"s": 12, "d": 3.0, "w": 2.0, "h": 0, "hs": 2.0}, *({"s": s} for s in range(13, 21))]
    else:
        lines = [{"s": s} for s in range(1, 21)]
    body = timed(lines, 12.0)
    start = {"process_start": 10.0, "loop_start": 12.0, "start_step": 0, "replicas": 2}
    write_ledger(run, 1, start, body, {"t": body[-1]["t"], "step": 20, "reason": "done"})
    return account(run)


def test_the_steps_a_heal_skipped_are_not_the_groups_and_its_earlier_steps_stay_committed(tmp_path):
    r = healed_group(tmp_path / "healed", heal=True)
    assert (r["committed_steps"], r["skipped_steps"], r["redone_steps"]) == (5 + 9, 6, 0)
    assert r["committed_tokens"] == 14 * TOKENS
    assert r["seconds"]["checkpoint_load"] == pytest.approx(2.0)  # the transfer from the peer
    assert r["seconds"]["data_wait"] == 0.0 and r["seconds"]["redone"] == 0.0
    assert r["seconds"]["productive"] == pytest.approx(5.0 + 9.0)
    assert r["seconds"]["restart_wait"] == pytest.approx(10.0 - 7.0)  # its last step (t=7) to the restart
    assert sum(r["seconds"].values()) == pytest.approx(r["wall_s"])
    # control: a relaunch without the heal runs steps 1-5 again (redone) and commits all 20 itself
    r = healed_group(tmp_path / "resumed", heal=False)
    assert (r["committed_steps"], r["skipped_steps"], r["redone_steps"]) == (20, 0, 5)
    assert r["seconds"]["checkpoint_load"] == 0.0


def test_steps_committed_by_fewer_groups_are_reduced_membership_with_their_tokens_kept(tmp_path):
    # steps 4-7 committed by 2 of 3 groups, faster (0.5 s): kept out of the full-membership rate
    lines = [*({"s": s} for s in range(1, 4)), *({"s": s, "r": 2, "d": 0.5} for s in range(4, 8)), {"s": 8}]
    r = one_launch(tmp_path / "ft", lines)
    assert r["seconds"]["reduced_membership"] == pytest.approx(2.0) and r["reduced_membership_steps"] == 4
    assert r["seconds"]["productive"] == pytest.approx(4.0)
    assert r["committed_tokens"] == 8 * TOKENS
    assert r["full_membership_tokens_per_s"] == pytest.approx(TOKENS / 1.0)
    assert r["goodput"] == pytest.approx(8 * TOKENS / (TOKENS * r["wall_s"]))
    assert "reduced_membership" not in r and "4 with fewer than 3 groups" in format_report(r)
    # control: without the marks every step is productive and the rate is the median of all eight
    r = one_launch(tmp_path / "control", [{k: v for k, v in x.items() if k != "r"} for x in lines], replicas=0)
    assert r["seconds"]["reduced_membership"] == 0.0 and r["seconds"]["productive"] == pytest.approx(6.0)
    assert r["full_membership_tokens_per_s"] == pytest.approx(TOKENS / 0.75)


def test_the_ledger_writes_the_replica_marks_the_accounting_reads(tmp_path):
    ledger = GoodputLedger(tmp_path / "goodput", launch=0)
    ledger.start(start_step=0, load_s=0.0, tokens_per_step=TOKENS, world_size=1, replicas=3)
    ledger.step(1, 1.0, 0.0, participants=3)
    ledger.step(2, 1.0, 0.0, committed=False)
    ledger.healed(1, 0.5)
    ledger.step(9, 1.0, 0.6, participants=2)
    ledger.step(10, 1.0, 0.0, participants=3)
    ledger.end(10, "done")
    launch = read_ledger(tmp_path / "goodput" / "launch-000.jsonl")
    assert launch.start["replicas"] == 3
    assert [{k: x[k] for k in ("s", "u", "r", "h", "hs") if k in x} for x in launch.steps] == [
        {"s": 1},
        {"s": 2, "u": 1},
        {"s": 9, "r": 2, "h": 1, "hs": 0.5},
        {"s": 10},
    ]
    r = account(tmp_path)
    assert (r["committed_steps"], r["skipped_steps"], r["redone_steps"], r["reduced_membership_steps"]) == (3, 7, 1, 1)
    # control: without replica FT (replicas 0) a participant count is not a reduced membership
    plain = GoodputLedger(tmp_path / "plain" / "goodput", launch=0)
    plain.start(start_step=0, load_s=0.0, tokens_per_step=TOKENS, world_size=1)
    plain.step(1, 1.0, 0.0, participants=2)
    plain.close()
    assert "r" not in read_ledger(tmp_path / "plain" / "goodput" / "launch-000.jsonl").steps[0]


def test_a_jobs_groups_sum_to_replica_seconds_and_the_cli_writes_its_goodput_json(tmp_path, capsys):
    # group 0: t=0..12, start-up 2 s, steps 1-10 of 1 s; group 1 starts at t=2, start-up 2 s, its first quorum
    # heals it to step 2 (0.5 s of its first step), steps 3-10 of 1 s, ends at t=12 too: 2 x 12 replica-seconds,
    # the scale of a whole-job run of the same 2 replicas
    job = tmp_path / "ft"
    one = timed([{"s": s} for s in range(1, 11)], 2.0)
    write_ledger(
        job / "replica-0",
        0,
        {"process_start": 0.0, "loop_start": 2.0, "start_step": 0, "replicas": 2},
        one,
        {"t": 12.0, "step": 10, "reason": "done"},
    )
    two = timed([{"s": 3, "h": 0, "hs": 0.5, "w": 0.5, "d": 1.0}, *({"s": s} for s in range(4, 11))], 4.0)
    write_ledger(
        job / "replica-1",
        0,
        {"process_start": 2.0, "loop_start": 4.0, "start_step": 0, "replicas": 2},
        two,
        {"t": 12.0, "step": 10, "reason": "done"},
    )
    (job / "replica_ft").mkdir()  # the launcher's folder is not a group
    assert [p.name for p in group_dirs(job)] == ["replica-0", "replica-1"]
    r = account_job(job)
    assert r["wall_s"] == pytest.approx(12.0) and r["replica_seconds"] == pytest.approx(24.0)
    assert sum(r["seconds"].values()) == pytest.approx(24.0)
    assert r["seconds"]["startup"] == pytest.approx(2.0 + 2.0 + 2.0)  # group 1's own, and its 2 s before it started
    assert r["seconds"]["checkpoint_load"] == pytest.approx(0.5)
    assert r["committed_tokens"] == (10 + 8) * TOKENS
    assert r["goodput"] == pytest.approx(18 * TOKENS / (2 * TOKENS * 12.0))
    assert [g["skipped_steps"] for g in r["groups"]] == [0, 2]
    assert goodput_main([str(job)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"goodput {r['goodput']:.3f}  {job}") and "replica-1: goodput" in out
    assert [line.split()[0] for line in out.splitlines()[2 : 2 + len(CAUSES)]] == list(CAUSES)
    assert json.loads((job / "goodput.json").read_text())["goodput"] == pytest.approx(r["goodput"])
    # control: a group's own directory is a run, accounted alone (its seconds, not the job's)
    assert group_dirs(job / "replica-1") == []
    assert account(job / "replica-1")["wall_s"] == pytest.approx(10.0)

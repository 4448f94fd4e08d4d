"""Loss guard, straggler rule, retry budget, orphan check and the launch dry-runs (single process)."""

from __future__ import annotations

import json
import statistics
import time

import torch

from lmforge.checkpoint.layout import COMPLETE, SIDECAR, step_dir
from lmforge.fault.loss_guard import LossGuard
from lmforge.fault.retry import load_state, record
from lmforge.fault.straggler import find_stragglers, reference_times


def test_loss_guard_skips_nonfinite_and_spikes_and_declares_divergence():
    g = LossGuard(spike_factor=2.0, window=10, max_consecutive=3)
    for i in range(6):
        g.step = i + 1
        assert g(torch.tensor(3.0), torch.tensor(1.0))
    g.step = 7
    assert not g(torch.tensor(float("nan")), torch.tensor(1.0)) and "non-finite loss" in g.last_cause
    g.step = 8
    assert not g(torch.tensor(2.0), torch.tensor(float("inf"))) and "grad norm" in g.last_cause
    g.step = 9
    assert not g(torch.tensor(7.0), torch.tensor(1.0)) and "spike" in g.last_cause
    assert g.diverged and g.first_bad_step == 7 and g.skipped_total == 3
    g.step = 10
    assert g(torch.tensor(3.1), torch.tensor(1.0)) and not g.diverged and g.consecutive == 0


def test_straggler_rule_names_ranks_slower_than_threshold_times_median():
    assert find_stragglers([1.0, 1.0, 1.1, 2.0], 1.5) == [3]
    assert find_stragglers([1.0, 1.2], 1.5) == []
    assert find_stragglers([], 1.5) == []


def test_two_ranks_name_the_one_twice_as_slow_as_its_peer():
    # The median of both ranks is their mean (1.5), so that rule would need rank 1 above 3x its peer; the median of
    # the other ranks is the peer's own time.
    assert find_stragglers([1.0, 2.0], 1.5) == [1]
    assert find_stragglers([2.0, 1.0], 1.5) == [0]
    assert find_stragglers([1.0, 1.0], 1.5) == []  # control: equal ranks
    assert find_stragglers([1.0, 1.4], 1.5) == []  # control: below the threshold
    assert find_stragglers([3.0], 1.5) == []  # one process: no peer to compare with
    assert reference_times([1.0, 2.0]) == [2.0, 1.0]


def test_a_larger_world_names_the_same_ranks_as_the_median_of_all():
    times = [1.0, 1.05, 0.95, 1.1, 1.0, 0.98, 2.4, 1.02]
    assert find_stragglers(times, 1.5) == [6]
    median = statistics.median(times)
    assert [r for r, t in enumerate(times) if t > 1.5 * median] == [6]  # the median of all ranks agrees
    assert find_stragglers([1.0] * 8, 1.5) == []  # control: an even world


def test_retry_budget_requeues_preemptions_and_limits_failures(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = tmp_path / "run"
    assert record(run, 0, signalled=True, max_failures=2).kind == "preempted"
    assert record(run, 42, signalled=False, max_failures=2).action == "requeue"
    assert record(run, 1, signalled=False, max_failures=2).reason == "exit 1: retry 1 of 2"
    assert record(run, 43, signalled=False, max_failures=2).action == "requeue"
    stop = record(run, 1, signalled=False, max_failures=2)
    assert stop.action == "stop" and "retry budget exhausted (2 of 2 retries used)" in stop.reason
    assert record(run, 45, signalled=False, max_failures=2).kind == "diverged"
    state = load_state(run)
    assert state["preemptions"] == 2 and state["failures"] == 2
    kinds = [json.loads(line)["event"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["requeue", "requeue", "requeue", "requeue", "retry_stop", "retry_stop"]
    (run / "DONE").write_text("{}")
    assert record(run, 0, signalled=False, max_failures=2).action == "done"


def test_watchdog_fires_after_timeout_dumps_stacks_and_exits_43(tmp_path):
    from lmforge.fault.events import FaultEvents
    from lmforge.fault.watchdog import Watchdog

    exits = []
    dog = Watchdog(
        3,
        timeout_s=0.3,
        dumps_dir=tmp_path / "dumps",
        poll_s=0.05,
        orphan_check=False,
        backstop_s=0,
        on_event=FaultEvents(tmp_path / "metrics.jsonl", 3).emit,
        exit=exits.append,
    ).start()
    dog.beat(5)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [43] and dog.fired == "watchdog"
    dump = next((tmp_path / "dumps").glob("watchdog-rank3-step5-*.txt")).read_text()
    assert "test_watchdog_fires_after_timeout" in dump  # the main thread's stack, waiting in this test
    event = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert event["event"] == "watchdog" and event["rank"] == 3 and event["step"] == 5


def test_paused_or_beating_watchdog_does_not_fire(tmp_path):
    from lmforge.fault.watchdog import Watchdog

    dog = Watchdog(0, timeout_s=0.5, dumps_dir=tmp_path, orphan_check=False, backstop_s=0)
    dog.beat(1)
    assert dog.check(now=dog.last_beat + 0.4) is None
    assert dog.check(now=dog.last_beat + 0.6) == "watchdog"
    dog.pause()
    assert dog.check(now=dog.last_beat + 100) is None
    fresh = Watchdog(0, timeout_s=0.5, dumps_dir=tmp_path, startup_s=10, orphan_check=False, backstop_s=0)
    assert fresh.check(now=fresh.last_beat + 5) is None  # before the first step the startup allowance applies


def test_straggler_rule_ignores_excess_below_the_floor():
    # A 2 ms window doubled by scheduling noise is no straggler when steps take 0.5 s (floor 5% = 25 ms).
    assert find_stragglers([0.002, 0.002, 0.005, 0.002], 1.5, min_excess=0.025) == []
    assert find_stragglers([0.002, 0.002, 0.305, 0.002], 1.5, min_excess=0.025) == [2]


def test_a_clean_stop_at_train_stop_at_step_with_its_checkpoint_is_done_not_a_preemption(tmp_path, monkeypatch):
    """A sweep's stable run (train.stop_at_step) ends with exit 0 and no DONE: done once its checkpoint at that
    step is complete; without the checkpoint, or when signalled, it is still a preemption to requeue."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = tmp_path / "run"
    assert record(run, 0, signalled=False, max_failures=2, stop_at_step=46).action == "requeue"  # no checkpoint
    ckpt = step_dir(run / "checkpoints", 46)
    ckpt.mkdir(parents=True)
    (ckpt / COMPLETE).write_text("")
    (ckpt / SIDECAR).write_text("{}")  # what makes a checkpoint complete (checkpoint/layout.py)
    assert record(run, 0, signalled=True, max_failures=2, stop_at_step=46).kind == "preempted"
    assert record(run, 0, signalled=False, max_failures=2).kind == "preempted"  # stop_at_step not given
    done = record(run, 0, signalled=False, max_failures=2, stop_at_step=46)
    assert (done.action, done.reason) == (
        "done",
        "the run stopped at train.stop_at_step=46 with its checkpoint (no DONE)",
    )

"""The hang watchdog on real gloo ranks: a rank blocked in a collective dumps its stacks and exits 43."""

from __future__ import annotations

import json
import socket

import pytest
from harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(120)
def test_rank_blocked_in_gloo_collective_dumps_stacks_and_exits(tmp_path):
    results = run_ranks(
        "distributed.fault_ranks:withheld_collective",
        2,
        {"run_dir": str(tmp_path), "timeout_s": 2.0, "hold_s": 8.0},
        timeout=90,
        check=False,
    )
    assert results[1].returncode == 43, results[1].output[-3000:]
    dumps = list((tmp_path / "dumps").glob("watchdog-rank1-step7-*.txt"))
    assert len(dumps) == 1, list(tmp_path.rglob("*"))
    stack = dumps[0].read_text()
    assert "reason: no heartbeat" in stack
    assert "all_reduce" in stack and "distributed_c10d.py" in stack and "withheld_collective" in stack, stack
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fired = [e for e in events if e["event"] == "watchdog"]
    assert len(fired) == 1 and fired[0]["rank"] == 1 and fired[0]["step"] == 7 and str(dumps[0]) in fired[0]["cause"]


@pytest.mark.timeout(120)
def test_straggler_gather_names_the_slow_rank_on_every_rank(tmp_path):
    results = run_ranks("distributed.fault_ranks:slow_rank", 3, {"run_dir": str(tmp_path)}, timeout=90)
    host = socket.gethostname()
    for r in results:
        assert r.value["stragglers"] == [1] and r.value["times"] == pytest.approx([0.1, 0.3, 0.1])
        assert r.value["hosts"] == [host] * 3  # gathered once at start, every rank's name by rank
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"], e["slow_rank"], e["rank"], e["host"]) for e in events] == [
        ("straggler", 4, 1, 1, host),
        ("straggler", 8, 1, 1, host),
    ]
    assert f"[lmforge fault] straggler rank=1 host={host} step=4: rank 1 is a straggler on host {host}" in (
        results[0].output
    )

"""Every ``cpu`` entry of tests/doc_commands.yaml run as printed, in manifest order, in one sandbox checkout
(``make smoke`` first: the later commands read runs/smoke): each exits as its entry says (0 unless ``exit:``),
within its own timeout. The CPU-seconds of each command are printed; a failure shows the command's output."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from doc_commands import load_manifest  # noqa: E402
from doc_sandbox import DEFAULT_TIMEOUT_S, make_sandbox, run_entry  # noqa: E402

ENTRIES = [e for e in load_manifest() if e["class"] == "cpu"]
TOTAL_TIMEOUT_S = sum(e.get("timeout_s", DEFAULT_TIMEOUT_S) for e in ENTRIES)


@pytest.mark.timeout(TOTAL_TIMEOUT_S)
def test_every_cpu_command_runs_as_printed(tmp_path, data_cache, capsys):
    env = make_sandbox(tmp_path, data_cache)
    failures, rows = [], []
    for entry in ENTRIES:
        outcome = run_entry(entry, tmp_path, env)
        want = entry.get("exit", 0)
        rows.append(f"{outcome.cpu_s:8.1f} {outcome.wall_s:8.1f}  {outcome.rc!s:>4}  {entry['command'][:110]}")
        with capsys.disabled():
            print(f"doc commands: {rows[-1]}", flush=True)
        if outcome.rc != want:
            status = "timed out" if outcome.rc is None else f"exited {outcome.rc}"
            failures.append(f"{entry['command']}\n  {status}, expected {want}; output:\n{outcome.output[-3000:]}")
    total = sum(float(r.split()[0]) for r in rows)
    with capsys.disabled():
        print(f"doc commands: {len(rows)} commands, {total:.0f} CPU-s", flush=True)
    assert not failures, f"{len(failures)} of {len(ENTRIES)} cpu commands failed:\n\n" + "\n\n".join(failures)

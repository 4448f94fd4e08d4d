"""W&B's own reader of an offline run's transaction log (``wandb leet inspect --json``), for every test that reads
a run back: one JSON record per line (``history`` records hold the rows, ``config`` and ``summary`` their updates)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def leet(run_dir: Path) -> list:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def history(records: list) -> list:
    """The logged rows, in order."""
    return [r["history"]["item"] for r in records if r.get("type") == "history"]


def updates(records: list, kind: str, key: str) -> list:
    """Every value ``key`` was given in the run's ``config`` or ``summary`` updates (``kind``), in order."""
    return [r[kind]["update"][key] for r in records if key in r.get(kind, {}).get("update", {})]

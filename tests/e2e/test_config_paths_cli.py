"""lmforge train refuses a run name outside run.root before anything is written (the CLI in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "train", *overrides],
        cwd=tmp_path,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(400)
def test_cli_refuses_a_run_name_outside_the_root_before_anything_is_written(tmp_path):
    root = tmp_path / "a" / "runs"
    out = _train(tmp_path, f"run.root={root}", "run.name=../../escaped", "model=tiny")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"lmforge: config key 'run.name': '../../escaped' climbs out with a '..' component, so the run would be "
        f"written outside run.root ({root}). Fix: give a name inside the root (e.g. run.name=escaped), or choose "
        f"the directory with run.root=DIR"
    )
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the escaped directory nor the root
    # Negative control: a name inside the root passes the path rule and fails on the next check instead.
    out = _train(tmp_path, f"run.root={root}", "run.name=inside", "model=tiny", "train.max_steps=0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "lmforge: config key 'train.max_steps': must be >= 1, got 0. Fix: set a positive value"
    )
    # ... and, refused after its run directory was made, it removes what it made: nothing is left either way
    assert not (tmp_path / "escaped").exists() and sorted(p.name for p in tmp_path.iterdir()) == []

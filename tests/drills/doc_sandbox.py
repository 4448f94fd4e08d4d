"""A sandbox checkout for running the docs' commands as printed: a working directory holding links to the
checkout's scripts and pages, the venv as ``.venv``, and an environment whose ``python`` is the venv's."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parents[2]
LINKED = ("launchers", "slurm", "benchmarks", "docs", "conf", "platform", "Makefile")
DEFAULT_TIMEOUT_S = 300


def make_sandbox(root: Path, data_cache: Path) -> Dict[str, str]:
    """Populate ``root`` and return the environment the commands run in. pyproject.toml is copied with the time of
    the venv's install stamp, so that ``make`` sees the venv it was built from as current (a worktree's newer
    pyproject.toml would make ``make smoke`` reinstall into the shared venv)."""
    venv = Path(sys.prefix)
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    (root / ".venv").symlink_to(venv)
    stamps = sorted(venv.glob(".installed-*"))
    if not stamps:
        raise AssertionError(f"{venv} has no .installed-* stamp: build the venv with `make install` first")
    (root / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    t = stamps[0].stat().st_mtime - 1
    os.utime(root / "pyproject.toml", (t, t))
    path = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join(p for p in [str(REPO / "platform"), os.environ.get("PYTHONPATH", "")] if p)
    return {
        **os.environ,
        "PATH": path,
        "PYTHONPATH": pythonpath,
        "VIRTUAL_ENV": str(venv),
        "LMFORGE_DATA_CACHE": str(data_cache),
        "LMFORGE_REPO": str(root),
        "LMFORGE_PYTHON": str(venv / "bin" / "python"),
    }


@dataclass
class Outcome:
    command: str
    rc: Optional[int]  # None: timed out
    output: str
    wall_s: float
    cpu_s: float


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_entry(entry: dict, cwd: Path, env: Dict[str, str]) -> Outcome:
    """An entry's setup lines, then its command, in one bash of its own process group: exit status, output, wall
    and CPU seconds. A command past its timeout is killed with everything it started (the group), and so is
    anything a finished command left running."""
    script = "\n".join(["set -e", *entry.get("setup", []), "set +e", entry["command"]])
    cpu0, t0 = children_cpu_s(), time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    rc: Optional[int] = None
    try:
        out, _ = proc.communicate(timeout=entry.get("timeout_s", DEFAULT_TIMEOUT_S))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, _ = proc.communicate()
    finally:
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Outcome(entry["command"], rc, out or "", time.monotonic() - t0, children_cpu_s() - cpu0)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass

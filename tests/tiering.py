"""The suite's three tiers, applied to every collected test by folder and by measured cost (a pytest plugin).

- ``fast``: tests/unit, in-process only. A test there that starts a Python, torchrun or Slurm subprocess fails
  (move it to tests/e2e or tests/distributed), and one whose recorded cost (tests/durations.json) is over
  ``FAST_LIMIT_S`` runs in the ``full`` tier instead, named in the session's summary until it is moved.
- ``full``: tests/distributed (several real ranks), tests/e2e (trainings and CLI subprocesses), tests/slurm.
- ``drills``: tests/drills, long fault and scale drills with a budget of their own.

``pytest --tier fast`` (or ``full``, ``drills``, a comma list, ``all``) selects; without ``--tier`` every tier but
the drills runs, and a drill runs when its path is named on the command line. Each test also carries its tier
as a marker (``-m fast``). tests/run_tiers.py runs the tiers one after another and accounts for each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest

TESTS_DIR = Path(__file__).resolve().parent
DURATIONS = TESTS_DIR / "durations.json"
TIERS = ("fast", "full", "drills")
FOLDER_TIERS = {"unit": "fast", "distributed": "full", "e2e": "full", "slurm": "full", "drills": "drills"}
FAST_LIMIT_S = 5.0  # a recorded cost above this (setup + call + teardown) is not a fast test
# Programs a fast test may not start: another Python (an import of torch alone costs seconds), torchrun, Slurm.
SLOW_PROGRAMS = ("python", "torchrun", "lmforge", "srun", "sbatch", "salloc", "slurmd", "slurmctld")

TIER_KEY = pytest.StashKey[str]()
DEMOTED = pytest.StashKey[list]()


def recorded_durations(path: Path = DURATIONS) -> Dict[str, float]:
    """The durations table (pytest-split's format: node id -> seconds), empty when it is missing."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def folder_tier(nodeid: str) -> Optional[str]:
    """The tier of a test from its folder, ``tests/<folder>/...`` (None outside the tiered folders)."""
    parts = Path(nodeid.split("::", 1)[0]).parts
    return FOLDER_TIERS.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None


def tier_of(nodeid: str, durations: Dict[str, float]) -> str:
    """A test's tier: its folder's, except that a fast test recorded over FAST_LIMIT_S runs in the full tier."""
    tier = folder_tier(nodeid) or "full"
    if tier == "fast" and durations.get(nodeid, 0.0) > FAST_LIMIT_S:
        return "full"
    return tier


def selected_tiers(option: Optional[str]) -> Sequence[str]:
    if option is None:
        return ("fast", "full")
    names = TIERS if option == "all" else tuple(t.strip() for t in option.split(",") if t.strip())
    unknown = [t for t in names if t not in TIERS]
    if unknown:
        raise pytest.UsageError(f"--tier {option}: unknown tier {unknown[0]!r}; choose from {', '.join(TIERS)} or all")
    return names


def slow_program(args) -> Optional[str]:
    """The name of the program a Popen call would start when a fast test may not start it, else None."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    if not argv:
        return None
    first = os.fsdecode(argv[0]).split()[0] if isinstance(argv[0], (str, bytes)) else os.fspath(argv[0])
    name = Path(first).name
    if first == sys.executable or name.startswith(SLOW_PROGRAMS):
        return name
    return None


def pytest_addoption(parser):
    group = parser.getgroup("lmforge tiers")
    group.addoption("--tier", default=None, help="fast, full, drills, a comma list, or all (default: fast,full)")


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (applied by tests/tiering.py, never by hand)")


def _named_on_command_line(config, item) -> bool:
    for arg in config.args:
        target = Path(arg.split("::", 1)[0]).resolve()
        if target == Path(item.fspath) or (target.is_dir() and target in Path(item.fspath).parents):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    durations = recorded_durations()
    wanted = selected_tiers(config.getoption("--tier"))
    explicit = config.getoption("--tier") is not None
    keep, drop, demoted = [], [], []
    for item in items:
        nodeid = item.nodeid  # relative to the repository root, as the durations table records it
        tier = tier_of(nodeid, durations)
        if tier == "full" and folder_tier(nodeid) == "fast":
            demoted.append(f"{nodeid} ({durations[nodeid]:.0f} s)")
        item.stash[TIER_KEY] = tier
        item.add_marker(tier)
        chosen = tier in wanted or (not explicit and tier == "drills" and _named_on_command_line(config, item))
        (keep if chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash[DEMOTED] = demoted


def pytest_terminal_summary(terminalreporter, config):
    demoted = config.stash.get(DEMOTED, [])
    if demoted:
        terminalreporter.write_line(
            f"tiers: {len(demoted)} test(s) in tests/unit are recorded over {FAST_LIMIT_S:.0f} s and ran in the "
            f"full tier; move them out of tests/unit: " + ", ".join(demoted)
        )


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_slow_process(request, monkeypatch):
    """In the fast tier, starting a Python, torchrun or Slurm process is an error that says where the test goes."""
    if request.node.stash.get(TIER_KEY, None) != "fast":
        yield
        return
    real_init = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        name = slow_program(args)
        if name is not None:
            raise AssertionError(
                f"{request.node.nodeid}: a fast-tier test (tests/unit) started `{name}` in a subprocess; "
                "move the test to tests/e2e (or tests/distributed for several ranks), or test the function in-process"
            )
        real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield

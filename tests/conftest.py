"""Shared fixtures. In CI (CI=true) a skipped test is a failure: nothing is silently left out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# logging.wandb.mode=auto (the default) follows W&B's own WANDB_MODE: the suite, and every process it starts, writes
# no W&B files unless a test asks for a mode itself (logging.wandb.mode=offline, or WANDB_MODE in its own env).
os.environ["WANDB_MODE"] = "disabled"
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The tiers (fast, full, drills): selection, markers and the fast tier's guard live in tiering.py.
from tiering import (  # noqa: E402, F401
    _fast_tier_starts_no_slow_process,
    pytest_addoption,
    pytest_configure,
    pytest_terminal_summary,
)
from tiering import pytest_collection_modifyitems as tier_collection  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped in CI, which counts as a failure: {reason}"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (two fighting over a loaded 2-core machine cost more CPU);
    restored afterwards. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One data cache (tokenizer, shards, indices) for the whole session, shared with subprocesses."""
    path = Path(os.environ.get("LMFORGE_TEST_DATA_CACHE", tmp_path_factory.mktemp("data-cache")))
    os.environ["LMFORGE_DATA_CACHE"] = str(path)
    return path


SMOKE_READERS = pytest.StashKey[bool]()
SMOKE_OVERLAP = pytest.StashKey[bool]()  # enough other tests selected to train under (else: both cores, now)


def pytest_collection_modifyitems(config, items):
    """Tiers first (tiering.py deselects what the run does not select), then the tests that read the smoke run go
    last. The run itself starts at the first test (``smoke_background``)
    at the lowest CPU priority, so it trains on the cycles the rest of the suite leaves idle (Slurm and fault
    tests wait on timers; most multi-rank tests use one thread a rank) instead of holding both cores for five
    minutes on its own."""
    tier_collection(config, items)
    readers = [item for item in items if "smoke_run" in getattr(item, "fixturenames", ())]
    config.stash[SMOKE_READERS] = bool(readers)
    config.stash[SMOKE_OVERLAP] = len(items) - len(readers) >= 50
    if readers:
        items[:] = [item for item in items if "smoke_run" not in getattr(item, "fixturenames", ())] + readers


@pytest.fixture(scope="session", autouse=True)
def smoke_background(request, tmp_path_factory):
    """The README's smoke experiment started once per session in the background (``nice -n 19``, one intra-op
    thread: two threads of a process that holds only the idle core would wait on each other at every op), with
    its own CPU-peak cache (a peak measured at nice 19 under load must not reach other runs). None when no
    selected test reads it. With few other tests selected (``pytest tests/e2e/test_smoke.py``) it runs exactly as
    the README does: default threads, normal priority."""
    if not request.config.stash.get(SMOKE_READERS, False):
        yield None
        return
    data_cache = request.getfixturevalue("data_cache")
    root = tmp_path_factory.mktemp("smoke")
    overlap = request.config.stash.get(SMOKE_OVERLAP, False)
    cmd = [
        sys.executable,
        "-m",
        "lmforge.train",
        "+exp=smoke",
        f"run.root={root}",
        "logging.console=plain",
        *(["train.threads=1"] if overlap else []),
    ]
    env = {**os.environ, "LMFORGE_DATA_CACHE": str(data_cache), "LMFORGE_CACHE": str(root / "lmforge-cache")}
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # W&B as a user's smoke run has it: auto, offline without a key
        env.pop(name, None)
    with open(root / "stdout.log", "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.nice(19)) if overlap else None,
        )
    try:
        yield proc, root
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def smoke_run(smoke_background) -> Path:
    """The smoke experiment's run directory once its run has finished; tests only read it."""
    proc, root = smoke_background
    try:
        rc = proc.wait(timeout=900)  # what is left of the run, now on a machine the other tests have released
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    log = (root / "stdout.log").read_text()
    assert rc == 0, f"smoke run failed ({rc}):\n{log[-6000:]}"
    return root / "smoke"

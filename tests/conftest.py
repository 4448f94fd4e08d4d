"""Shared fixtures. In CI (CI=true) a skipped test is a failure: nothing is silently left out."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


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


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, data_cache) -> Path:
    """The smoke experiment run once per session, exactly as the README runs it; tests only read it."""
    root = tmp_path_factory.mktemp("smoke")
    cmd = [sys.executable, "-m", "lmforge.train", "+exp=smoke", f"run.root={root}", "logging.console=plain"]
    env = {**os.environ, "LMFORGE_DATA_CACHE": str(data_cache)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    (root / "stdout.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"smoke run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return root / "smoke"

"""A worker's start composes the config once and records what @hydra.main records (counted in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

# Counts Hydra's config loads in a real ``lmforge.train`` start (the config is refused by validate() in run():
# train.max_steps=0, exit 2, after Hydra has written its .hydra/ record into the run directory).
COUNTING_START = """
import sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
loads = []
load = ConfigLoaderImpl.load_configuration
ConfigLoaderImpl.load_configuration = lambda self, *a, **k: loads.append(1) or load(self, *a, **k)
from lmforge.train import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(f"loads={len(loads)} code={code}")
"""


def start(tmp_path, *args):
    proc = subprocess.run(
        [sys.executable, "-c", COUNTING_START, *args],
        cwd=tmp_path,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=150,
    )
    return proc.stdout.strip().splitlines()[-1], proc.stderr


@pytest.mark.timeout(300)
def test_a_worker_start_composes_once_and_records_what_hydra_main_records(tmp_path):
    base = ["model=tiny", f"run.root={tmp_path / 'runs'}", "train.max_steps=0"]
    for name in ("once", "main"):  # there before the start: the refused start keeps them, with Hydra's record
        (tmp_path / "runs" / name).mkdir(parents=True)
    out, err = start(tmp_path, *base, "run.name=once")
    assert out == "loads=1 code=2", err
    assert err.strip().splitlines()[-1] == (
        "lmforge: config key 'train.max_steps': must be >= 1, got 0. Fix: set a positive value"
    )
    # Negative control: a Hydra flag goes through @hydra.main as before: three loads (the run-name check's,
    # hydra.main's for hydra.mode, and its run's).
    out, err = start(tmp_path, *base, "run.name=main", "--config-name=config")
    assert out == "loads=3 code=2", err
    once, main = (
        yaml.safe_load((tmp_path / "runs" / n / ".hydra" / "hydra.yaml").read_text())["hydra"] for n in ("once", "main")
    )
    assert once["mode"] == main["mode"] == "RUN" and once["job"]["name"] == main["job"]["name"] == "train"
    assert once["overrides"]["hydra"] == main["overrides"]["hydra"] == ["hydra.mode=RUN"]
    assert once["overrides"]["task"] == [*base, "run.name=once"] and once["job_logging"] == main["job_logging"]
    assert (tmp_path / "runs" / "once" / "train.log").exists() and (tmp_path / "runs" / "main" / "train.log").exists()
    assert once["runtime"]["output_dir"] == str(tmp_path / "runs" / "once") and once["job"]["chdir"] is False
    runs = {n: tmp_path / "runs" / n for n in ("once", "main")}
    assert {n: sorted(p.name for p in d.rglob("*")) for n, d in runs.items()} == {
        n: [".hydra", "config.yaml", "hydra.yaml", "overrides.yaml", "rank0.json", "train.log", "verdicts"]
        for n in runs
    }
    task = {n: yaml.safe_load((d / ".hydra" / "config.yaml").read_text()) for n, d in runs.items()}
    assert task["once"] == {**task["main"], "run": {**task["main"]["run"], "name": "once"}}
    # A config naming hydra.callbacks starts through @hydra.main, which runs them: the plain composition (1), then
    # the run-name check's and hydra.main's two.
    callback = "+hydra.callbacks.noop._target_=hydra.experimental.callback.Callback"
    out, err = start(tmp_path, *base, "run.name=callbacks", callback)
    assert out == "loads=4 code=2", err

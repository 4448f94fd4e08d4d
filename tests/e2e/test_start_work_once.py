"""A training start does its entry work once (``trainer.entry_checks``): a resumed start loads the tokenizer once,
lists the checkpoints once (``checkpoint.layout.latest``) and reads the resume sidecar once, though the eval tasks,
the resume target and the data epochs are all checked before the Trainer builds anything.

Two real tiny runs of ``lmforge.train.main`` in subprocesses: the first trains 2 steps and checkpoints, the second
resumes it. Each runs under counting wrappers installed before lmforge's modules import the functions (every
``from ... import`` then binds the wrapper), and writes its counts when ``main`` returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = [
    "model=tiny",
    "train.max_steps=4",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "train.device=cpu",
    "logging.console=plain",
    "logging.every_steps=1",
    "checkpoint.every_steps=2",
    "run.name=once",
]

# Installed before lmforge.train (and so any module that imports these names) is imported.
RUNNER = """
import json, pathlib, sys
import lmforge.checkpoint.layout as layout
import lmforge.data.tokenizer as tokenizer

counts = {"load_tokenizer": 0, "latest": 0, "sidecar_reads": 0}


def counting(name, fn):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return wrapper


tokenizer.load_tokenizer = counting("load_tokenizer", tokenizer.load_tokenizer)
layout.latest = counting("latest", layout.latest)
read_text = pathlib.Path.read_text


def reading(self, *args, **kwargs):  # every read of a checkpoint sidecar goes through Path.read_text
    if self.name == layout.SIDECAR:
        counts["sidecar_reads"] += 1
    return read_text(self, *args, **kwargs)


pathlib.Path.read_text = reading
out = pathlib.Path(sys.argv.pop(1))
from lmforge.train import main

try:
    rc = main()
finally:
    out.write_text(json.dumps(counts))
sys.exit(rc)
"""


def start(tmp_path: Path, name: str, extra):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    counts = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(runner), str(counts), f"run.root={tmp_path}", *COMMON, *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(counts.read_text()), proc.stdout


@pytest.mark.timeout(400)
def test_a_resumed_start_loads_the_tokenizer_lists_checkpoints_and_reads_the_sidecar_once(tmp_path, data_cache):
    fresh, out = start(tmp_path, "fresh", ["train.stop_at_step=2"])
    assert (tmp_path / "once" / "checkpoints" / "step-00000002" / "COMPLETE").is_file(), out
    assert "resumed from step" not in out
    resumed, out = start(tmp_path, "resumed", ["train.stop_at_step=3"])
    assert "resumed from step 2" in out, out  # a real resume (model, optimizer, data position)
    assert (tmp_path / "once" / "checkpoints" / "step-00000003" / "COMPLETE").is_file(), out
    # fresh: nothing to resume, so no sidecar read; the tokenizer loaded and the checkpoints listed once.
    # resumed: the same, and the sidecar read once (lmforge.train checks the target before the data; the Trainer
    # resumes from that same ResumePoint). Before entry_checks: fresh 2, 2, 0 and resumed 3, 3, 2.
    assert {"fresh": fresh, "resumed": resumed} == {
        "fresh": {"load_tokenizer": 1, "latest": 1, "sidecar_reads": 0},
        "resumed": {"load_tokenizer": 1, "latest": 1, "sidecar_reads": 1},
    }


# One check added to the start-up path (trainer.startup: every start runs its check_start), refusing the run
# directories named "refuse"; validate() and the entry checks counted per start (by run directory name).
ADDED_CHECK = """
import importlib, json, pathlib, sys
import lmforge.trainer.startup as startup
from lmforge.config.errors import ConfigError

calls = []
validate, entry_checks = startup.validate, startup.entry_checks


def counted_validate(*args, **kwargs):
    calls.append("validate")
    return validate(*args, **kwargs)


def refusing_entry_checks(cfg, **kwargs):
    checks = entry_checks(cfg, **kwargs)
    run_dir = kwargs.get("run_dir")
    calls.append(f"entry_checks {None if run_dir is None else run_dir.name}")
    if run_dir is not None and run_dir.name == "refuse":
        raise ConfigError("run.name", "refused by the check added to the start-up", "drop that check")
    return checks


startup.validate, startup.entry_checks = counted_validate, refusing_entry_checks
out, module = pathlib.Path(sys.argv.pop(1)), sys.argv.pop(1)
try:
    rc = importlib.import_module(module).main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
finally:
    out.write_text(json.dumps(calls))
sys.exit(rc)
"""
REFUSED = "lmforge: config key 'run.name': refused by the check added to the start-up. Fix: drop that check"


def start_with_the_added_check(tmp_path: Path, module: str, args, env=None):
    runner = tmp_path / "added_check.py"
    runner.write_text(ADDED_CHECK)
    calls = tmp_path / f"{module}.calls.json"
    proc = subprocess.run(
        [sys.executable, str(runner), str(calls), module, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    return proc, json.loads(calls.read_text())


def sweep_of_two_points(tmp_path: Path) -> Path:
    """A planned tiny sweep cut to two points, ``refuse`` and ``ok`` (2 steps), each in its own run directory."""
    from lmforge.cli import main as lmforge

    root = tmp_path / "sweep-runs"
    assert (
        lmforge(["sweep", "plan", "--preset", "tiny_cpu", "--name", "s", "--budgets", "1e10", "--run-root", str(root)])
        == 0
    )
    plan = root / "s" / "sweep.json"
    data = json.loads(plan.read_text())
    first, points = data["points"][0], []
    for pid in ("refuse", "ok"):
        keep = [
            o
            for o in first["overrides"]
            if not o.startswith(("run.sweep_point=", "train.max_steps=", "train.planned_tokens="))
        ]
        overrides = [*keep, "train.max_steps=2", "train.eval_every=0", f"run.sweep_point=s/{pid}"]
        points.append(
            {**first, "id": pid, "sweep_point": f"s/{pid}", "run_dir": str(root / "s" / pid), "overrides": overrides}
        )
    data["points"] = points
    plan.write_text(json.dumps(data))
    return plan


@pytest.mark.timeout(600)
def test_a_check_added_once_refuses_lmforge_train_a_sweep_point_and_the_slurm_prepare_step(tmp_path, data_cache):
    base = ["model=tiny", f"run.root={tmp_path / 'runs'}", "train.device=cpu", "train.threads=1", "run.name=refuse"]
    # lmforge train: one line, exit 2, this rank's verdict; validate() and the entry checks once each. The run
    # directory is there before the launch (a refused start removes a directory it made itself, verdict included).
    (tmp_path / "runs" / "refuse").mkdir(parents=True)
    proc, calls = start_with_the_added_check(tmp_path, "lmforge.train", base)
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (2, REFUSED), proc.stderr[-3000:]
    assert calls == ["validate", "entry_checks refuse"]
    verdict = json.loads((tmp_path / "runs" / "refuse" / "verdicts" / "rank0.json").read_text())
    assert verdict["kind"] == "config_error" and verdict["exit_code"] == 2, verdict

    # A sweep point: refused with the same check and its verdict recorded; the next point (the check lets it
    # through) trains to the end. Each point validated and entry-checked once.
    plan = sweep_of_two_points(tmp_path)
    proc, calls = start_with_the_added_check(tmp_path, "lmforge.scaling.worker", [str(plan)])
    assert proc.returncode == 1 and "[sweep] failed points: refuse" in proc.stderr, proc.stderr[-3000:]
    assert calls == ["validate", "entry_checks refuse", "validate", "entry_checks ok"]
    refused = plan.parent / "refuse"
    verdict = json.loads((refused / "verdicts" / "rank0.json").read_text())
    assert verdict["kind"] == "config_error" and REFUSED.removeprefix("lmforge: ") in verdict["message"], verdict
    assert "refused by the check added" in (refused / "logs" / "sweep-failure.txt").read_text()
    assert (plan.parent / "ok" / "DONE").is_file() and not (refused / "DONE").exists()

    # The Slurm prepare step (slurm/train.sh: jobctl prepare): the same line and exit code, before any worker.
    job = {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "node1", "SLURM_NNODES": "1", "SLURM_CPUS_ON_NODE": "4"}
    proc, calls = start_with_the_added_check(
        tmp_path, "lmforge.launch.jobctl", ["prepare", "--", *base, "cluster.gpus_per_node=1"], job
    )
    assert (proc.returncode, proc.stderr.strip().splitlines()[-1]) == (2, REFUSED), proc.stderr[-3000:]
    assert calls == ["validate", "entry_checks refuse"] and proc.stdout == ""

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

"""Launching a run again, through the real entry point (``python -m lmforge.train``) in subprocesses: a run that
trained is never silently rewritten.

One tiny run: a launch stops at step 2 (``train.stop_at_step``, which says how to go on), the next resumes it to
its ``train.max_steps=4`` (finished, ``DONE``). Then, on the finished run: another LR with fewer steps, and eval
tasks, are each refused in one line (exit 2) with ``config.yaml``, every ``state.json``, the metrics and the launch
records byte for byte as they were; more steps with the same config (the negative control) trains on from step
4, writing only new files. The decision logic, case by case: tests/unit/test_relaunch.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    "checkpoint.keep_last=5",
    "run.name=r",
]


def launch(root: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lmforge.train", f"run.root={root}", *COMMON, *extra]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=240)


def records(run: Path) -> dict:
    """What a launch must not rewrite: the run's config, metrics, DONE, launch records and every sidecar."""
    files = [
        run / "config.yaml",
        run / "metrics.jsonl",
        run / "DONE",
        *run.glob("launches/*"),
        *run.glob("**/state.json"),
    ]
    return {str(p.relative_to(run)): p.read_bytes() for p in files if p.is_file()}


def ours(proc: subprocess.CompletedProcess) -> list:
    return [line for line in proc.stderr.splitlines() if line.startswith("lmforge:")]


@pytest.mark.timeout(600)
def test_a_finished_run_is_refused_or_continued_never_rewritten(tmp_path, data_cache):
    run, ckpt = tmp_path / "r", tmp_path / "r" / "checkpoints"
    first = launch(tmp_path, "train.stop_at_step=2")
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    events = [line for line in lines if line.startswith("[event]")]
    assert events == [
        f"[event] checkpoint_save step=2 rank=0 path={ckpt / 'step-00000002'}",
        f"[event] checkpoint_commit step=2 rank=0 path={ckpt / 'step-00000002'}",
    ], first.stdout  # a synchronous save is written, then committed
    assert lines[-1] == (
        f"lmforge: stopped at step 2 of train.max_steps=4 (train.stop_at_step=2); checkpoint {ckpt / 'step-00000002'}."
        " To continue: the same command without train.stop_at_step (train.resume=auto resumes from step 2)"
    )
    second = launch(tmp_path)
    assert second.returncode == 0 and (run / "DONE").is_file(), second.stderr[-3000:]
    assert second.stdout.count("resumed from step 2") == 1, second.stdout
    assert f"[event] resume step=2 rank=0 resumed from step 2 path={ckpt / 'step-00000002'}" in second.stdout
    assert not any(line.endswith(" ") for line in first.stdout.splitlines() + second.stdout.splitlines())
    before = records(run)
    assert sorted(k for k in before if k.startswith("launches/")) == [
        "launches/launch-000.yaml",
        "launches/launch-001.yaml",
    ]

    finished = ckpt / "step-00000004"
    lower = launch(tmp_path, "optim.lr=1e-3", "train.max_steps=2")
    assert lower.returncode == 2 and "Traceback" not in lower.stderr, lower.stderr[-3000:]
    assert ours(lower) == [
        f"lmforge: config key 'train.max_steps': the run is finished: checkpoint {finished} is at step 4, and "
        "train.max_steps=2 leaves nothing to train (this launch changes optim.lr 0.0003 -> 0.001, train.max_steps 4 "
        f"-> 2). Fix: start a new run with run.name=r-2 (add train.init_from={finished} to start from its weights)"
    ]
    assert "resumed from" not in lower.stdout and records(run) == before
    scored = launch(tmp_path, "eval.tasks=[austen_word_order]")
    assert scored.returncode == 2 and ours(scored) == [
        f"lmforge: config key 'train.max_steps': the run is finished: checkpoint {finished} is at step 4, and "
        'train.max_steps=4 leaves nothing to train (this launch changes eval.tasks [] -> ["austen_word_order"]). '
        f"Fix: score the checkpoint without training: python -m lmforge.evaluation.offline {finished} --tasks "
        "austen_word_order"
    ], scored.stderr[-3000:]
    assert records(run) == before

    longer = launch(tmp_path, "train.max_steps=6")  # negative control: the same config, more steps, trains on
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "resumed from step 4" in longer.stdout and (ckpt / "step-00000006" / "COMPLETE").is_file()
    after = records(run)
    assert after != before and {k: after[k] for k in before if k not in ("metrics.jsonl", "DONE")} == {
        k: v for k, v in before.items() if k not in ("metrics.jsonl", "DONE")
    }  # config.yaml, the launch records and step 2's and 4's state.json as they were; metrics appended to
    assert after["metrics.jsonl"].startswith(before["metrics.jsonl"])
    record = yaml.safe_load(after["launches/launch-002.yaml"])
    assert (record["start_step"], record["resumed_from"]) == (4, str(finished))
    assert record["changed"] == {"train.max_steps": {"checkpoint": 4, "launch": 6}}
    assert yaml.safe_load(after["config.yaml"])["train"]["max_steps"] == 4  # the config that started the run

"""``logging.tensorboard=true`` through the real entry point (``python -m lmforge.train``, two launches of a tiny
run: the first is SIGKILLed after step 4 with its last checkpoint at step 2, the next resumes from step 2 and
finishes at step 5), read back with TensorBoard's own reader: the train, validation and checkpoint series at the
trainer's steps, and each step's loss equal to the one metrics.jsonl kept last (step 3, logged by both launches,
shows the resumed launch's value once), and the event files in the run's modes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from file_modes_check import wrong_modes
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

COMMON = [
    "model=tiny",
    "train.max_steps=5",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.threads=1",
    "train.device=cpu",
    "logging.console=plain",
    "logging.every_steps=1",
    "logging.tensorboard=true",
    "checkpoint.every_steps=2",
    "run.name=r",
]


@pytest.mark.timeout(300)
def test_two_launches_write_one_tensorboard_history_equal_to_the_metrics(tmp_path, data_cache):
    for extra, code in ((["fault.drill.kill_step=4"], -9), ([], 0)):
        cmd = [sys.executable, "-m", "lmforge.train", f"run.root={tmp_path}", *COMMON, *extra]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert proc.returncode == code, proc.stderr[-3000:]
    run = tmp_path / "r"
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "tokens_seen", "val/books/loss", "checkpoint/write_s"} <= tags, tags
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 3, 4, 5]  # the second launch resumed at step 2 and redid 3
    kept = {r["step"]: r["loss"] for r in train}  # the later launch's value of a redone step
    shown = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert shown == [(s, pytest.approx(loss, rel=1e-6)) for s, loss in sorted(kept.items())]
    assert wrong_modes(run / "tensorboard") == []

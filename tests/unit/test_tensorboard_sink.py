"""The TensorBoard sink (metrics/tensorboard_sink.py), read back with TensorBoard's own reader: the series W&B
gets, at the trainer's step, and a resumed launch's redone steps replacing the earlier launch's; the package
check that refuses ``logging.tensorboard=true`` without it."""

from __future__ import annotations

import importlib.util

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lmforge.config.errors import ConfigError
from lmforge.config.logging import LoggingConfig, check_sink_packages
from lmforge.metrics.series import EventCounter, record_row
from lmforge.metrics.tensorboard_sink import TensorBoardSink


def train(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "time": 1000.0 + step, "loss": loss, "tokens_seen": 64 * step, "mfu": 0.1}


def read(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_the_series_are_w_and_bs_names_at_the_trainer_step(tmp_path):
    sink = TensorBoardSink(tmp_path, start_step=0, config_yaml="optim:\n  lr: 0.001\n")
    records = [train(1, 9.0), train(2, 8.5)]
    evaluation = {"kind": "eval", "step": 2, "val/books/loss": 8.7, "val/books/bpb": 3.1}
    save = {"kind": "event", "event": "checkpoint_commit", "step": 2, "rank": 0, "write_s": 0.25, "path": "x"}
    restart = {"kind": "event", "event": "restart", "step": 2, "rank": 0, "cause": "worker died"}
    for record in records + [evaluation]:
        sink.log(record)
    for record in (save, restart):
        sink.event(record)
    sink.close()
    acc = read(tmp_path)
    counter = EventCounter()
    expected = set(record_row(records[0])) | set(record_row(evaluation))
    expected |= set(counter.row(save)) | set(counter.row(restart))
    assert (
        set(acc.Tags()["scalars"])
        == expected
        == {
            "train/loss",
            "train/mfu",
            "tokens_seen",
            "val/books/loss",
            "val/books/bpb",
            "checkpoint/write_s",
            "events/restart",
        }
    )
    assert scalars(acc, "train/loss") == [(1, 9.0), (2, 8.5)]
    assert scalars(acc, "tokens_seen") == [(1, 64.0), (2, 128.0)]
    assert scalars(acc, "events/restart") == [(2, 1.0)]
    assert [e.wall_time for e in acc.Scalars("train/loss")] == [1001.0, 1002.0]
    assert "config" in " ".join(acc.Tags()["tensors"])  # the config as text at step 0


def test_a_resumed_launch_replaces_the_steps_it_redoes(tmp_path):
    first = TensorBoardSink(tmp_path, start_step=0)
    for step in range(1, 6):  # the first launch logs to step 5, its last checkpoint is at step 3
        first.log(train(step, 10.0 + step))
    first.close()
    second = TensorBoardSink(tmp_path, start_step=3)  # resumed from step 3: redoes 4 and 5, then 6
    for step in range(4, 7):
        second.log(train(step, 20.0 + step))
    second.close()
    assert scalars(read(tmp_path), "train/loss") == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0), (5, 25.0), (6, 26.0)]


def test_without_a_resume_step_nothing_is_purged_negative_control(tmp_path):
    """The same two launches, the second opened as if fresh: the earlier launch's steps 4 and 5 stay beside the
    redone ones, which is what purge_step prevents."""
    first = TensorBoardSink(tmp_path, start_step=0)
    for step in range(1, 6):
        first.log(train(step, 10.0 + step))
    first.close()
    second = TensorBoardSink(tmp_path, start_step=0)
    for step in range(4, 7):
        second.log(train(step, 20.0 + step))
    second.close()
    assert len(scalars(read(tmp_path), "train/loss")) == 8


def test_tensorboard_without_its_package_is_refused_in_one_line(monkeypatch):
    check_sink_packages(LoggingConfig(tensorboard=True))  # installed here: passes
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        check_sink_packages(LoggingConfig(tensorboard=True))
    assert str(e.value) == (
        "config key 'logging.tensorboard': is true but the tensorboard package is not installed. Fix: pip install "
        "'lmforge[tensorboard]' (or pip install tensorboard), or set logging.tensorboard=false"
    )
    check_sink_packages(LoggingConfig(tensorboard=False))  # off: nothing to check

"""checkpoint.async_mode=process: DCP's writer process logs its warnings and errors, not an INFO line per save.

The writer itself runs end to end in tests/e2e/test_first_start.py (a run with process saves, stderr read); here:
its logging setup against torch's own (the negative control), and that the spawned process starts through it."""

from __future__ import annotations

import logging
import pickle

import pytest

from lmforge.checkpoint import async_process


@pytest.fixture
def root_logger():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def emit_both(root: logging.Logger) -> None:
    root.info("Waiting for checkpoint save request...")
    root.warning("the disk is nearly full")


def test_writer_logging_keeps_warnings_with_their_rank_and_drops_info(root_logger, capsys):
    async_process.writer_logging(3)
    emit_both(root_logger)
    lines = capsys.readouterr().err.splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("[3] ")
        and lines[0].endswith(" - root - WARNING - the disk is nearly full")
    )


def test_negative_control_torchs_own_writer_logging_prints_the_info_lines(root_logger, capsys):
    from torch.distributed.checkpoint import _async_process_executor

    _async_process_executor._init_logger(3)
    emit_both(root_logger)
    err = capsys.readouterr().err
    assert " - root - INFO - Waiting for checkpoint save request..." in err and "WARNING" in err


def test_the_spawned_writer_starts_through_lmforges_entry(monkeypatch):
    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess

    torch_entry = _AsyncCheckpointProcess.__dict__["_checkpointing_subprocess"]
    monkeypatch.setattr(_AsyncCheckpointProcess, "_checkpointing_subprocess", torch_entry)  # restored afterwards
    monkeypatch.setattr(async_process, "_ORIGINAL", None)
    assert async_process.install() and async_process.install()  # idempotent
    target = (
        _AsyncCheckpointProcess._checkpointing_subprocess
    )  # what Process(target=self._checkpointing_subprocess) gets
    assert target is async_process._start_writer
    assert pickle.loads(pickle.dumps(target)) is async_process._start_writer  # spawn sends it by name
    assert async_process._ORIGINAL is torch_entry.__func__

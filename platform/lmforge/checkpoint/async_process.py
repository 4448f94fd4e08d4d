"""``checkpoint.async_mode=process``: DCP's background writer process, logging warnings and errors only.

torch starts the writer (``torch.distributed.checkpoint._async_process_executor``) as a spawned process whose
first act sets its root logger to INFO with a stderr handler, so every save printed five INFO lines per rank
("Received async checkpoint request ...", "Completed checkpoint save request ...", "Waiting for checkpoint save
request ...") and the start three more. :func:`install` (the manager calls it before a process save) makes the
process start through :func:`_start_writer`, which gives it the same handler and format at WARNING: a warning or
an error of the writer still prints, with its rank; its INFO lines do not. Nothing else about the writer changes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

LEVEL = logging.WARNING
_ORIGINAL: Optional[Callable[..., None]] = None  # torch's process entry, kept by install() in the training process


def writer_logging(rank: int) -> None:
    """The writer process's logging: torch's handler and format (``[rank] time - name - level - message``), at
    ``LEVEL``."""
    root = logging.getLogger()
    root.setLevel(LEVEL)
    handler = logging.StreamHandler()
    handler.setLevel(LEVEL)
    handler.setFormatter(logging.Formatter(f"[{rank}] %(asctime)s - %(name)s - %(levelname)s - %(message)s"))
    root.addHandler(handler)


def _executor() -> Any:
    from torch.distributed.checkpoint import _async_process_executor

    return _async_process_executor


def _start_writer(pg_init_info: Any, parent_conn: Any) -> None:
    """The writer process's entry (runs in the spawned process): torch's, with :func:`writer_logging`."""
    executor = _executor()
    executor._init_logger = writer_logging
    original = _ORIGINAL or executor._AsyncCheckpointProcess._checkpointing_subprocess  # the spawned process's own
    if original is _start_writer:
        raise RuntimeError("the checkpoint writer's entry point was replaced twice")
    original(pg_init_info, parent_conn)


def install() -> bool:
    """Start DCP's writer processes through :func:`_start_writer` from now on (idempotent). False when this torch
    has no such process entry (its writer then logs as torch sets it)."""
    global _ORIGINAL
    try:
        process = _executor()._AsyncCheckpointProcess
        current = process._checkpointing_subprocess
        _executor()._init_logger  # noqa: B018 - the function _start_writer replaces must exist too
    except (ImportError, AttributeError):
        return False
    if current is not _start_writer:
        _ORIGINAL = current
        process._checkpointing_subprocess = staticmethod(_start_writer)
    return True

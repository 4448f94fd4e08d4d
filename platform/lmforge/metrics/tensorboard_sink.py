"""TensorBoard sink (``logging.tensorboard=true``; rank 0 only): the series W&B gets (metrics/series.py), as
TensorBoard scalars in ``<run>/tensorboard`` at the trainer's step, for users of Megatron's and NeMo's
``--tensorboard-dir`` (``tensorboard --logdir runs`` shows every run).

- Steps: a resumed launch opens its writer with ``purge_step`` one past the step it resumed from, so TensorBoard
  hides what an earlier launch wrote for the steps this launch redoes: each step keeps the value of the launch
  whose checkpoints the run went on from (W&B instead keeps the redone rows as new rows: metrics/wandb_sink.py).
- Each record is flushed to disk as it is logged (TensorBoard's writer would otherwise hold up to two minutes of
  them), so a launch that is killed keeps what it logged, as metrics.jsonl does.
- The resolved config (secrets redacted, as ``config.yaml``) as a text summary at a fresh start's step 0.
- Event files are written by TensorBoard's own writer (``torch.utils.tensorboard``); the ``tensorboard`` package is
  an optional dependency (the ``lmforge[tensorboard]`` extra), checked by ``validate()`` before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lmforge.metrics.series import EventCounter, record_row


class TensorBoardSink:
    def __init__(self, log_dir: Path, *, start_step: int, config_yaml: Optional[str] = None):
        from torch.utils.tensorboard import SummaryWriter  # deferred: tensorboard is an optional dependency

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step > 0 else None)
        self.events = EventCounter()
        if config_yaml is not None and start_step == 0:
            self.writer.add_text("config", "```yaml\n" + config_yaml + "```", global_step=0)

    def _add(self, row: dict, record: dict) -> None:
        if "step" not in record:
            return
        step, walltime = int(record["step"]), record.get("time")
        for name, value in row.items():
            self.writer.add_scalar(name, value, global_step=step, walltime=walltime)

    def log(self, record: dict) -> None:
        self._add(record_row(record), record)
        self.writer.flush()  # a record per logging interval: on disk before a crash can lose it (like the JSONL)

    def event(self, record: dict) -> None:
        self._add(self.events.row(record), record)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

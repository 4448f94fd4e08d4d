"""Count host syncs of a real training run, per step.

On a GPU every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``tolist()``)
dispatches ``aten._local_scalar_dense`` and waits for the device. The same op runs on the CPU, so a
dispatch mode that records it finds, on a CPU run, every place a GPU run would stall. The probe records
``trainer.step`` at each such read: during the compute of step ``k`` the trainer's counter is ``k - 1``, during
the logging after it ``k``.
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SyncRecorder(TorchDispatchMode):
    def __init__(self, trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self.steps: Counter = Counter()
        self.where: Dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            step = self.trainer.step
            self.steps[step] += 1
            if step not in self.where:  # the first caller outside torch, for the failure message
                frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
                self.where[step] = f"{frames[-1].filename}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        return func(*args, **(kwargs or {}))


def syncs_per_step(overrides: List[str], run_dir: str) -> dict:
    """Train with ``overrides`` (in this process / rank); return {step: host reads} and where they came from."""
    from lmforge.config.compose import compose
    from lmforge.trainer.startup import start

    trainer = start(compose(overrides), Path(run_dir))
    recorder = SyncRecorder(trainer)
    with recorder:
        trainer.fit()
    return {
        "counts": {str(k): v for k, v in sorted(recorder.steps.items())},
        "where": {str(k): v for k, v in recorder.where.items()},
        "losses": [r["loss"] for r in trainer.history],
    }

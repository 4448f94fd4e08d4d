"""Run inside a fresh process by tests/unit/test_data_prefetch.py (tests/harness.run_ranks, world of one).

Trains the same tiny run through the real Trainer with ``data.num_workers`` 0 and 2, one after the other in
this process, and reports what the loop saw. It also leaves one prefetching stream unclosed on purpose: the
process must still exit (the prefetch threads are daemons), or the harness's hard timeout fails the test.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Dict, List


def prefetch_threads() -> List[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lmforge-data") and t.is_alive())


def train_with_workers(root: str, cache: str, workers: List[int], steps: int) -> Dict[str, dict]:
    from lmforge.config.compose import compose
    from lmforge.data.loader import BatchStream
    from lmforge.trainer.startup import start

    os.environ["LMFORGE_DATA_CACHE"] = cache
    out: Dict[str, dict] = {}
    for w in workers:
        overrides = [
            "model=tiny",
            f"train.max_steps={steps}",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "train.eval_every=0",
            "train.threads=1",
            "train.deterministic=true",
            "train.precision=fp32",
            "train.device=cpu",
            "optim.warmup_steps=1",
            "optim.lr=3e-3",
            "logging.every_steps=1",
            "logging.console=none",
            "checkpoint.enabled=false",
            f"data.num_workers={w}",
            f"run.root={root}",
            f"run.name=w{w}",
        ]
        trainer = start(compose(overrides), Path(root) / f"w{w}")
        history = trainer.fit()
        out[str(w)] = {
            "loss": [r["loss"] for r in history],
            "grad_norm": [r["grad_norm"] for r in history],
            "consumed": [r["consumed_samples"] for r in history],
            "prefetcher_after_fit": trainer.data.prefetcher is not None,
            "threads_after_fit": prefetch_threads(),
        }
        if w:  # a stream nobody closes: its daemon threads must not keep the process alive at exit
            left_open = BatchStream(trainer.mixture, trainer.plan, dp_rank=0, device=trainer.device, num_workers=w)
            left_open.step_batches()
            out[str(w)]["threads_left_open"] = prefetch_threads()
        del trainer
    return out

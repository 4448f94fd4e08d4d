"""Rank-side code of the in-loop evaluation parity test: one launch, several layouts built one after another on the
same 2 ranks; each scores a shipped task through the Engine contract (``TaskRunner.run``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

import torch
from distributed.parallel_worker import build_config, build_engine, init_world


def eval_layouts(layouts: Dict[str, List[str]], task: str, limit: int) -> Dict[str, dict]:
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.evaluation.runner import TaskRunner
    from lmforge.evaluation.tasks import load_task

    init_world()
    tok = load_tokenizer("embedded", Path(os.environ["LMFORGE_DATA_CACHE"]))
    loaded = load_task(task)
    out = {}
    for name, overrides in layouts.items():
        cfg = build_config(overrides)
        engine = build_engine(cfg)
        engine.eval()
        runner = TaskRunner([loaded], tok.encode, eod=tok.eod, seq_len=cfg.model.seq_len, batch_size=4, limit=limit)
        metrics, records = runner.run(engine)
        out[name] = {"metrics": metrics, "lls": [r["lls"] for r in records[loaded.name]]}
        del engine
        torch.distributed.barrier()
    return out

"""Downstream tasks in the training loop, on the training mesh, through the Engine contract only.

Built once at start-up (the tasks' requests are encoded once); ``run(engine)`` is called by the trainer on every
evaluation step, on every rank (collectives: the engine's forwards; one all-reduce of the scores over dp).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lmforge.evaluation.scoring import DataParallel, LogprobFn, TokenRequest, encode_pair, score, task_metrics
from lmforge.evaluation.tasks import Request, Task


class TaskRunner:
    def __init__(
        self,
        tasks: Sequence[Task],
        encode: Callable[[str], List[int]],
        *,
        eod: int,
        seq_len: int,
        batch_size: int,
        limit: int = 0,
    ):
        self.tasks = list(tasks)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.limit = limit
        self.requests: List[List[List[Request]]] = [t.all_requests(limit) for t in self.tasks]
        self.token_requests: List[List[TokenRequest]] = [
            [encode_pair(encode, eod, r.context, r.continuation) for doc in per_doc for r in doc]
            for per_doc in self.requests
        ]

    def run_fn(
        self, logprob_fn: LogprobFn, device: torch.device, dp: Optional[DataParallel] = None
    ) -> Tuple[Dict[str, float], Dict[str, List[Dict[str, Any]]]]:
        """``eval/<task>/<metric>`` for every task, and each task's per-document records."""
        metrics: Dict[str, float] = {}
        records: Dict[str, List[Dict[str, Any]]] = {}
        for task, per_doc, toks in zip(self.tasks, self.requests, self.token_requests):
            scores = score(toks, logprob_fn, seq_len=self.seq_len, batch_size=self.batch_size, device=device, dp=dp)
            values, records[task.name] = task_metrics(task, per_doc, scores, self.limit)
            metrics.update({f"eval/{task.name}/{k}": v for k, v in values.items()})
        return metrics, records

    def run(self, engine) -> Tuple[Dict[str, float], Dict[str, List[Dict[str, Any]]]]:
        """On the engine's mesh: batches sharded over data-parallel ranks, every rank gets every score."""
        dp = DataParallel(engine.dp_rank, engine.dp_size, engine.dp_group) if engine.dp_size > 1 else None
        return self.run_fn(engine.token_logprobs, engine.device, dp)

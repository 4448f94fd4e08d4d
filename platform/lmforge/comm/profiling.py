"""The trainer's overlap probe: every ``metrics.profile_every`` steps, profile one step and log its overlap.

``metrics.profile_every=null`` (the default) profiles every ``AUTO_PROFILE_EVERY`` steps on runs of more than one
process, so every multi-rank run measures its overlap; each rank keeps the traces of the ``KEEP_TRACES`` newest
profiled steps. The trainer leaves a profiled step out of throughput, MFU and goodput.

    probe = OverlapProbe(cfg.metrics.profile_every, paths.traces, device)
    with probe.step(step, logger):          # a no-op except on profiled steps
        result = engine.train_step(batches, lr)

On a profiled step every rank records the step with ``torch.profiler``, keeps the Chrome trace as
``<run>/traces/step<N>-rank<R>.json`` (open it in Perfetto / chrome://tracing), analyses it with
``lmforge.comm.overlap`` and sends its numbers to rank 0, which logs one ``kind="overlap"`` record (and a
per-rank, per-collective table to W&B). Every rank must call ``step`` with the same step numbers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

from lmforge.comm.overlap import KindStats, OverlapStats, aggregate, analyze_trace
from lmforge.comm.wandb_tables import log_overlap, wandb_run_of
from lmforge.runtime.file_modes import make_dir, set_file

STEP_ANNOTATION = "lmforge.step"
# metrics.profile_every=null on a run of more than one process: one profiled step in this many costs 0.13% of the
# training time of model=tiny on the CPU and 0.02% of the smoke model's, where the profiler records every operator
# (benchmarks/overlap_probe.py, docs/collectives.md "Cost"); a GPU profile records kernels.
AUTO_PROFILE_EVERY = 500
KEEP_TRACES = 3  # the newest profiled steps whose traces each rank keeps (older ones are deleted)


def profile_interval(setting: Optional[int], world_size: int) -> int:
    """``metrics.profile_every`` as the probe uses it: null (auto) is ``AUTO_PROFILE_EVERY`` with more than one
    process and off in one (nothing to overlap); 0 is off; N is every N steps."""
    if setting is None:
        return AUTO_PROFILE_EVERY if world_size > 1 else 0
    return setting


class OverlapProbe:
    def __init__(self, every: int, traces_dir: Path, device: torch.device):
        self.every = every
        self.traces_dir = Path(traces_dir)
        self.device = device
        self.last: Optional[dict] = None  # the last aggregated record (rank 0), for tests and callers

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    @contextlib.contextmanager
    def step(self, step: int, logger: Any) -> Iterator[None]:
        if not self.due(step):
            yield
            return
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            with record_function(STEP_ANNOTATION):
                yield
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        self._report(prof, step, logger)

    def _report(self, prof: Any, step: int, logger: Any) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        make_dir(self.traces_dir)
        path = self.traces_dir / f"step{step:07d}-rank{rank}.json"
        prof.export_chrome_trace(str(path))
        set_file(path)  # the profiler's file takes the run's modes (runtime/file_modes.py)
        prune_traces(self.traces_dir, rank, KEEP_TRACES)
        stats = analyze_trace(path, STEP_ANNOTATION, rank)
        gathered: List[Optional[dict]] = [stats.to_json()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, stats.to_json())
        if rank != 0:
            return
        per_rank = [_from_json(g) for g in gathered if g is not None]
        record = {**aggregate(per_rank, step), "comm/trace_dir": str(self.traces_dir)}
        self.last = record
        logger.log(record)
        log_overlap(wandb_run_of(logger), record, [g for g in gathered if g is not None], step=step)


def _from_json(data: dict) -> OverlapStats:
    data = dict(data)
    kinds = {k: KindStats(**v) for k, v in data.pop("per_kind").items()}
    return OverlapStats(per_kind=kinds, **data)


def prune_traces(traces_dir: Path, rank: int, keep: int) -> List[Path]:
    """Delete this rank's traces but the ``keep`` newest steps' (a long run keeps a few, not one per interval);
    returns the deleted paths."""
    mine = sorted(traces_dir.glob(f"step*-rank{rank}.json"))  # step numbers are zero-padded: sorted by step
    gone = mine[:-keep] if keep > 0 else mine
    for path in gone:
        path.unlink(missing_ok=True)
    return gone

"""Straggler detection by each rank's own compute time, gathered every ``metrics.straggler_every`` steps.

Wall step times cannot find a straggler: every step ends in synchronous collectives (gradient reduction, the
loss all-reduce), so the fast ranks wait for the slow one and all ranks report the same step time. What
differs is the time a rank spends *before it has to wait for anyone*. :class:`ComputeClock` measures, per
step, the time from the top of the loop (after the previous step's last collective) until the rank enters
the step's first blocking collective:

- DDP, replicated data parallelism with a manual all-reduce, one process: the end of the local backward
  (the last gradient accumulated; DDP's bucket all-reduces are asynchronous and are waited for only after
  it), so the window holds data loading, forward and backward;
- FSDP2 and tensor parallelism: the root module's forward pre-hook, just before the first all-gather /
  all-reduce, so the window holds the work between steps (data, host-side extra work) but not the forward;
- pipeline parallelism and other engines: the entry into ``train_step`` (stages receive before computing).

On the CPU the clock is the host's ``perf_counter``; on a GPU a CUDA event pair on the compute stream at the
same points, read (after waiting for the last event) only on gather steps. The first two steps of a launch
(one-time set-up on every rank, DDP's bucket rebuild) are left out.

A rank is a straggler when its mean compute time over the window exceeds ``threshold`` x its *reference*, the
median of the OTHER ranks' times, and the reference by at least 5% of the median wall step time (a few milliseconds
of scheduling noise in a short window is no straggler). The rank itself is left out of its reference so that small
worlds work: with 2 ranks the median of both is their mean, and a rank would be named only when more than 3x
slower than its peer at the default threshold of 1.5 (``t > 1.5 * (t + p) / 2`` means ``t > 3 p``); against the
median of the others it is named when 1.5x slower than its peer. In a larger world the median of the others differs
from the median of all only within the middle of the distribution (for a slow rank it is the lower middle value), so
it names the same ranks but for borderline cases; a single process has no reference and no straggler.

The slow rank's host is named too: ``gather_hostnames`` all-gathers every rank's host name once, when the fault
hooks start (one extra all_gather at start, none per step). The per-window gather stays one small all_gather
every ``every`` steps (every rank joins it). Rank 0 records one ``straggler`` event per slow rank (metrics JSONL,
W&B, and a console line on stderr, led by the slow rank and its host: ``straggler rank=R host=H step=S: ...``)
and the step's metrics get ``compute_time_max_over_median``: the slowest rank's time over its reference.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lmforge.config.parallelism import ParallelismConfig
from lmforge.runtime.dist import world_size

# A rank is named only when its excess over the median is also at least this share of the median wall step
# time: under FSDP/TP the window can be a few milliseconds, where scheduling noise alone doubles it.
MIN_EXCESS_OF_STEP = 0.05


# Room for a host name in the start-up gather (Linux host names have at most 64 bytes, fully qualified ones 253).
HOSTNAME_BYTES = 256


def reference_times(times: List[float]) -> List[float]:
    """Each rank's reference: the median of the other ranks' times (0.0 for a single rank: no reference)."""
    if len(times) < 2:
        return [0.0] * len(times)
    return [statistics.median(times[:r] + times[r + 1 :]) for r in range(len(times))]


def find_stragglers(times: List[float], threshold: float, min_excess: float = 0.0) -> List[int]:
    """Ranks whose time exceeds ``threshold`` x the median of the other ranks, and that median by ``min_excess``."""
    refs = reference_times(times)
    return [
        r for r, (t, ref) in enumerate(zip(times, refs)) if ref > 0 and t > threshold * ref and t - ref >= min_excess
    ]


def gather_hostnames(device: torch.device) -> List[str]:
    """Every rank's host name, by rank: one all_gather of a fixed-size byte tensor (every rank joins it); this
    process's name alone without a process group of more than one rank."""
    mine = socket.gethostname()
    if world_size() <= 1:
        return [mine]
    raw = mine.encode("utf-8")[:HOSTNAME_BYTES]
    buf = torch.zeros(HOSTNAME_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    buf = buf.to(device)
    out = [torch.zeros_like(buf) for _ in range(world_size())]
    dist.all_gather(out, buf)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for t in out]


def describe_straggler(
    found: Dict[str, object], r: int, *, host: str, threshold: float, every: int, mode: str
) -> Tuple[str, dict]:
    """The cause line and the event fields of slow rank ``r`` in one gather's result (``StragglerDetector.observe``)
    on ``host``; ``mode`` is where the compute window ends (``ComputeClock.mode``)."""
    times, walls, refs = found["times"], found["wall_times"], found["references"]
    cause = (
        f"rank {r} is a straggler on host {host}: mean compute time {times[r]:.3f}s per step > {threshold} x the "
        f"median of the other ranks {refs[r]:.3f}s over the last {every} steps (compute = loop top to {mode}; wall "
        f"step time {walls[r]:.3f}s)"
    )
    fields = {
        "slow_rank": r,
        "compute_time_s": times[r],
        "median_s": refs[r],
        "step_time_s": walls[r],
        "compute_times_s": times,
        "step_times_s": walls,
    }
    return cause, fields


class ComputeClock:
    """Per-step compute time of this rank: loop top -> first blocking collective of the step (see module doc)."""

    ENTRY, FORWARD, GRADS = "train_step entry", "forward pre-hook", "last local gradient"
    WARMUP_STEPS = 2

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.mode = self.ENTRY
        self._t0 = 0.0
        self._mark: Optional[float] = None
        self._ev0 = self._ev_mark = None
        self._pending: list = []  # host seconds, or (start event, end event) pairs on CUDA
        self._handles: list = []
        # The first steps of a launch are not booked: one-time set-up on every rank, and DDP rebuilds its buckets
        # in the second forward with a blocking broadcast (the fast ranks would wait inside the window).
        self._warmup = self.WARMUP_STEPS

    @classmethod
    def mode_for(cls, parallelism: ParallelismConfig) -> str:
        """Where the layout's first blocking collective of a step is (see the module doc), from the config."""
        if parallelism.engine != "native" or parallelism.pp > 1:
            return cls.ENTRY
        if parallelism.dp_shard > 1 or parallelism.tp > 1:
            return cls.FORWARD
        return cls.GRADS

    def attach(self, engine, parallelism: ParallelismConfig) -> "ComputeClock":
        """Install the marks for the layout: on the engine's ``model`` (the wrapped root module, whose forward
        pre-hook runs before the first all-gather) or on the parameters of its ``inner`` model."""
        self.mode = self.mode_for(parallelism)
        if self.mode == self.FORWARD:
            self._handles.append(engine.model.register_forward_pre_hook(lambda *_: self._first_mark(), prepend=True))
        elif self.mode == self.GRADS:
            for p in engine.inner.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(lambda _p: self._latest_mark()))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- the loop's calls -------------------------------------------------------------------------
    def begin(self) -> None:
        self._mark = None
        self._ev_mark = None
        self._t0 = time.perf_counter()
        if self.cuda:
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev0.record()

    def entering_step(self) -> None:
        if self.mode == self.ENTRY:
            self._first_mark()

    def end(self) -> None:
        """The step returned: book its compute time (the window ends at the mark, else now)."""
        if self._mark is None:
            self._first_mark()
        if self._warmup > 0:
            self._warmup -= 1
            return
        if self.cuda:
            self._pending.append((self._ev0, self._ev_mark))
        else:
            self._pending.append(self._mark - self._t0)

    def drain(self) -> List[float]:
        """Compute seconds of the steps booked since the last drain (waits for their CUDA events)."""
        out = []
        for item in self._pending:
            if isinstance(item, tuple):
                item[1].synchronize()
                out.append(item[0].elapsed_time(item[1]) / 1000.0)
            else:
                out.append(item)
        self._pending = []
        return out

    # ---- marks ------------------------------------------------------------------------------------
    def _first_mark(self) -> None:
        if self._mark is not None:
            return
        self._latest_mark()

    def _latest_mark(self) -> None:
        self._mark = time.perf_counter()
        if self.cuda:
            if self._ev_mark is None:
                self._ev_mark = torch.cuda.Event(enable_timing=True)
            self._ev_mark.record()  # re-recording moves it: the latest call wins


class StragglerDetector:
    def __init__(self, every: int, threshold: float, device: torch.device):
        self.every = every
        self.threshold = threshold
        self.device = device
        self.hosts: List[str] = []  # every rank's host name, by rank (``gather_hostnames``, at start)
        self._wall = 0.0
        self._n = 0

    def observe(
        self, step: int, step_time_s: float, clock: Optional[ComputeClock] = None
    ) -> Optional[Dict[str, object]]:
        """Record one step; on gather steps return {'times', 'wall_times', 'references', 'stragglers', 'median'}
        where ``times`` are the ranks' mean compute times (``clock``; the wall step time without one), ``references``
        each rank's median of the other ranks' times and ``median`` the median of all."""
        if self.every <= 0:
            return None
        self._wall += step_time_s
        self._n += 1
        if step % self.every != 0:
            return None
        n = max(1, self._n)
        computes = clock.drain() if clock is not None else []
        wall = self._wall / n
        compute = sum(computes) / len(computes) if computes else wall
        self._wall, self._n = 0.0, 0
        if world_size() > 1:
            mine = torch.tensor([compute, wall], dtype=torch.float64, device=self.device)
            out = [torch.zeros_like(mine) for _ in range(world_size())]
            dist.all_gather(out, mine)
            pairs = [t.tolist() for t in out]
        else:
            pairs = [[compute, wall]]
        times, walls = [p[0] for p in pairs], [p[1] for p in pairs]
        floor = MIN_EXCESS_OF_STEP * statistics.median(walls)
        return {
            "times": times,
            "wall_times": walls,
            "references": reference_times(times),
            "stragglers": find_stragglers(times, self.threshold, floor),
            "median": statistics.median(times),
        }

    def host(self, rank: int) -> str:
        """Rank ``rank``'s host name ('?' before ``gather_hostnames`` filled ``hosts``)."""
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else "?"

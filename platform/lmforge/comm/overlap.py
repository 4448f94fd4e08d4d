"""How much collective time is hidden behind compute, from one profiled step's trace (pure functions).

Input: the events of a Chrome trace as ``torch.profiler`` exports it (complete events: ``ph="X"``, ``ts`` and
``dur`` in microseconds, ``cat``, ``name``, ``tid``). Two timelines are read:

- **GPU traces** (any ``kernel`` event): communication = NCCL kernels (``ncclDevKernel_AllReduce_...``,
  ``ncclKernel_...``); compute = every other kernel, memcpy and memset on any stream.
- **CPU traces** (gloo): communication = the backend's collective spans (``gloo:all_reduce``, ...), which
  run on the process group's worker threads; compute = the operator events (``cat="cpu_op"``) on the training
  thread (the thread of the step annotation), minus the time spent inside collective launches and waits
  on that thread (``c10d::*``, ``gloo:*``/``nccl:*``, ``record_param_comms``, ``*wait*``).

Then, with interval unions per rank:

    total    = |union(communication)|
    exposed  = |union(communication) - union(compute)|   (communication nothing else was running beside)
    overlap  = 1 - exposed / total

and the same per collective type (each type's own union; types that run at the same time are counted in
each, so per-type totals can add up to more than ``total``). See docs/collectives.md for the limits.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

Interval = Tuple[float, float]

_BACKEND_SPAN = re.compile(r"^(?:gloo|nccl|mpi|ucc|xccl):([a-z_]+)$")
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_LAUNCH = re.compile(
    r"^(?:c10d::|c10d_functional::|_c10d_functional::|gloo:|nccl:|record_param_comms)|wait", re.IGNORECASE
)
GPU_COMPUTE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_CAMEL = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoallv": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "send_recv",
    "send": "send",
    "recv": "recv",
    "gather": "gather",
    "scatter": "scatter",
}


def collective_kind(name: str) -> Optional[str]:
    """'gloo:all_reduce' -> 'all_reduce'; 'ncclDevKernel_AllGather_RING_LL(...)' -> 'all_gather'; else None."""
    m = _BACKEND_SPAN.match(name)
    if m:
        kind, prev = m.group(1).strip("_"), None
        while kind != prev:
            prev, kind = kind, re.sub(r"_(coalesced|base|into_tensor|tensor|single)$", "", kind)
        return _CAMEL.get(kind.replace("_", ""), kind)
    m = _NCCL_KERNEL.match(name)
    if m:
        key = m.group(1).lower()
        return _CAMEL.get(key, key)
    return None


# ---- interval algebra ------------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> List[Interval]:
    out: List[List[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> List[Interval]:
    """The parts of union(a) not covered by union(b)."""
    cut = union(b)
    out: List[Interval] = []
    for start, end in union(a):
        cur = start
        for bs, be in cut:
            if be <= cur or bs >= end:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= end:
                break
        if cur < end:
            out.append((cur, end))
    return out


def clip(intervals: Iterable[Interval], window: Optional[Interval]) -> List[Interval]:
    if window is None:
        return list(intervals)
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


# ---- classification --------------------------------------------------------------------------------------
@dataclass
class Timeline:
    mode: str  # gpu | cpu
    comm: Dict[str, List[Interval]]  # collective type -> intervals
    compute: List[Interval]
    window: Optional[Interval]


def _span(e: dict) -> Interval:
    ts = float(e["ts"])
    return ts, ts + float(e.get("dur", 0.0))


def complete_events(events: Iterable[dict]) -> List[dict]:
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def classify(events: Sequence[dict], step_name: Optional[str] = None) -> Timeline:
    """Split one rank's trace into communication (by type) and compute intervals, within the step window."""
    events = complete_events(events)
    step = next((e for e in events if step_name and e.get("name") == step_name), None)
    window = _span(step) if step is not None else None
    comm: Dict[str, List[Interval]] = defaultdict(list)
    compute: List[Interval] = []
    if any(e.get("cat") == "kernel" for e in events):
        for e in events:
            if e.get("cat") not in GPU_COMPUTE_CATS:
                continue
            kind = collective_kind(e.get("name", "")) if e.get("cat") == "kernel" else None
            (comm[kind] if kind else compute).append(_span(e))
        mode = "gpu"
    else:
        if step is not None:
            main_tid = step.get("tid")
        else:
            busy = Counter()
            for e in events:
                if e.get("cat") == "cpu_op":
                    busy[e.get("tid")] += float(e.get("dur", 0.0))
            main_tid = busy.most_common(1)[0][0] if busy else None
        launches: List[Interval] = []
        for e in events:
            name = e.get("name", "")
            kind = collective_kind(name)
            if kind and e.get("cat") != "kernel" and e.get("tid") != main_tid:
                comm[kind].append(_span(e))
            elif e.get("tid") == main_tid and e.get("cat") == "cpu_op":
                (launches if _LAUNCH.search(name) else compute).append(_span(e))
            elif kind and e.get("tid") == main_tid:
                # a collective span on the training thread itself (a backend running it inline): communication
                comm[kind].append(_span(e))
                launches.append(_span(e))
        compute = subtract(compute, launches)
        mode = "cpu"
    clipped = {k: clip(v, window) for k, v in comm.items()}
    return Timeline(mode, {k: v for k, v in clipped.items() if v}, clip(compute, window), window)


# ---- statistics ------------------------------------------------------------------------------------------
@dataclass
class KindStats:
    total_us: float
    exposed_us: float
    overlap_fraction: Optional[float]
    count: int


@dataclass
class OverlapStats:
    mode: str
    total_us: float
    exposed_us: float
    overlap_fraction: Optional[float]  # None when the step had no communication
    compute_us: float
    step_us: Optional[float]
    per_kind: Dict[str, KindStats] = field(default_factory=dict)
    rank: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def _fraction(total: float, exposed: float) -> Optional[float]:
    return 1.0 - exposed / total if total > 0 else None


def overlap_stats(timeline: Timeline, rank: int = 0) -> OverlapStats:
    all_comm = [i for v in timeline.comm.values() for i in v]
    total = length(all_comm)
    exposed = length(subtract(all_comm, timeline.compute))
    per_kind = {}
    for kind, intervals in sorted(timeline.comm.items()):
        k_total = length(intervals)
        k_exposed = length(subtract(intervals, timeline.compute))
        per_kind[kind] = KindStats(k_total, k_exposed, _fraction(k_total, k_exposed), len(intervals))
    step_us = timeline.window[1] - timeline.window[0] if timeline.window else None
    return OverlapStats(
        timeline.mode, total, exposed, _fraction(total, exposed), length(timeline.compute), step_us, per_kind, rank
    )


def load_trace(path: Path) -> List[dict]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def analyze_trace(path_or_events, step_name: Optional[str] = None, rank: int = 0) -> OverlapStats:
    events = load_trace(path_or_events) if isinstance(path_or_events, (str, Path)) else path_or_events
    return overlap_stats(classify(events, step_name), rank)


def aggregate(per_rank: Sequence[OverlapStats], step: int) -> dict:
    """A flat metrics record over ranks: summed times (per rank means), job-wide overlap, worst rank."""
    n = max(1, len(per_rank))
    total = sum(s.total_us for s in per_rank)
    exposed = sum(s.exposed_us for s in per_rank)
    record = {
        "kind": "overlap",
        "step": step,
        "comm/mode": per_rank[0].mode if per_rank else "none",
        "comm/total_ms": total / n / 1e3,
        "comm/exposed_ms": exposed / n / 1e3,
        "comm/compute_ms": sum(s.compute_us for s in per_rank) / n / 1e3,
    }
    frac = _fraction(total, exposed)
    if frac is not None:
        record["comm/overlap_fraction"] = frac
        record["comm/overlap_fraction_min"] = min(
            s.overlap_fraction for s in per_rank if s.overlap_fraction is not None
        )
    steps = [s.step_us for s in per_rank if s.step_us]
    if steps:
        record["comm/profiled_step_ms"] = max(steps) / 1e3
    kinds = sorted({k for s in per_rank for k in s.per_kind})
    for kind in kinds:
        k_total = sum(s.per_kind[kind].total_us for s in per_rank if kind in s.per_kind)
        k_exposed = sum(s.per_kind[kind].exposed_us for s in per_rank if kind in s.per_kind)
        record[f"comm/{kind}/total_ms"] = k_total / n / 1e3
        record[f"comm/{kind}/exposed_ms"] = k_exposed / n / 1e3
        k_frac = _fraction(k_total, k_exposed)
        if k_frac is not None:
            record[f"comm/{kind}/overlap_fraction"] = k_frac
    return record


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lmforge.comm.overlap TRACE.json [STEP_NAME]``: re-analyse a kept trace file."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m lmforge.comm.overlap TRACE.json[.gz] [STEP_ANNOTATION]", file=sys.stderr)
        return 2
    stats = analyze_trace(Path(args[0]), args[1] if len(args) > 1 else "lmforge.step")
    print(json.dumps(stats.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

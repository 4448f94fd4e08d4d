"""Collective bandwidth bench over the current world: algorithm and bus bandwidth as nccl-tests defines them.

For one operation on ``size`` bytes that takes ``time`` seconds on ``n`` ranks (nccl-tests, doc/PERFORMANCE.md):

    algbw = size / time
    busbw = algbw * factor(op, n)
        all_reduce       2(n-1)/n   (size = the buffer every rank holds)
        all_gather       (n-1)/n    (size = the gathered output; each rank sends size/n)
        reduce_scatter   (n-1)/n    (size = the input; each rank receives size/n)
        all_to_all       (n-1)/n    (size = what each rank sends, = what it receives)
        broadcast        1          (size = the buffer)

Bus bandwidth is comparable across operations and world sizes: it is the rate each rank's busiest link
must sustain, so it can be held against the hardware link speed. Units are GB/s = 10^9 bytes/s.
The time of one size is the mean over ``iters`` back-to-back calls, and the slowest rank's time is used.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from lmforge.runtime.file_modes import write_text

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ELEMENT_BYTES = 4  # float32


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction factor for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective '{op}'; known: {', '.join(OPS)}")


def algbw_gbps(size_bytes: int, time_s: float) -> float:
    return size_bytes / time_s / 1e9


def busbw_gbps(op: str, size_bytes: int, time_s: float, n: int) -> float:
    return algbw_gbps(size_bytes, time_s) * bus_factor(op, n)


def parse_size(text: str) -> int:
    """'8', '4K', '16M', '1G' (binary multiples) -> bytes."""
    text = text.strip().upper().rstrip("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    return int(float(number) * mult)


def size_sweep(min_bytes: int, max_bytes: int, factor: int = 2) -> List[int]:
    sizes, s = [], max(1, min_bytes)
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    if not sizes or sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def aligned_size(size_bytes: int, n: int) -> int:
    """Round down to whole float32 elements that split evenly over ``n`` ranks (at least one per rank)."""
    unit = ELEMENT_BYTES * n
    return max(unit, size_bytes // unit * unit)


@dataclass
class BenchRow:
    op: str
    size_bytes: int
    count: int  # float32 elements in ``size_bytes``
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass
class BenchResult:
    backend: str
    world_size: int
    device: str
    iters: int
    warmup: int
    rows: List[BenchRow] = field(default_factory=list)
    floor_gbps: float = 0.0
    floor_ops: List[str] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def ops(self) -> List[str]:
        return list(dict.fromkeys(r.op for r in self.rows))

    def peak_busbw(self, op: str) -> float:
        return max(r.busbw_gbps for r in self.rows if r.op == op)

    def latency_us(self, op: str) -> float:
        """Small-message latency: the time of the smallest message in the sweep."""
        return min(self.rows_of(op), key=lambda r: r.size_bytes).time_us

    def rows_of(self, op: str) -> List[BenchRow]:
        return [r for r in self.rows if r.op == op]

    def check_floor(self, floor_gbps: float, ops: Sequence[str]) -> List[str]:
        """Fail every op in ``ops`` whose peak bus bandwidth is below ``floor_gbps`` (0 disables)."""
        self.floor_gbps, self.floor_ops, self.failures = floor_gbps, list(ops), []
        if floor_gbps <= 0:
            return []
        for op in ops:
            if op in self.ops() and self.peak_busbw(op) < floor_gbps:
                self.failures.append(
                    f"{op} peak bus bandwidth {self.peak_busbw(op):.3g} GB/s < floor {floor_gbps:g} GB/s"
                )
        return self.failures

    def summary(self) -> Dict[str, float]:
        """Flat scalars for the metrics stream: per op peak bus/alg bandwidth and small-message latency."""
        out: Dict[str, float] = {
            "comm_bench/world_size": self.world_size,
            "comm_bench/passed": float(self.passed),
            "comm_bench/floor_gbps": self.floor_gbps,
        }
        for op in self.ops():
            out[f"comm_bench/{op}/busbw_gbps"] = self.peak_busbw(op)
            out[f"comm_bench/{op}/algbw_gbps"] = max(r.algbw_gbps for r in self.rows_of(op))
            out[f"comm_bench/{op}/latency_us"] = self.latency_us(op)
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def table(self) -> str:
        head = f"{'op':<15}{'size(B)':>12}{'count':>11}{'time(us)':>12}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"
        lines = [
            f"# lmforge comm bench: backend={self.backend} world_size={self.world_size} device={self.device} "
            f"iters={self.iters} warmup={self.warmup}",
            head,
        ]
        for r in self.rows:
            lines.append(
                f"{r.op:<15}{r.size_bytes:>12d}{r.count:>11d}{r.time_us:>12.1f}{r.algbw_gbps:>13.4f}"
                f"{r.busbw_gbps:>13.4f}"
            )
        for op in self.ops():
            lines.append(
                f"# {op}: peak busbw {self.peak_busbw(op):.4f} GB/s, small-message latency {self.latency_us(op):.1f} us"
            )
        if self.floor_gbps > 0:
            verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)
            lines.append(f"# floor {self.floor_gbps:g} GB/s on {', '.join(self.floor_ops)}: {verdict}")
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(self.to_json(), indent=1))
        write_text(path.with_suffix(".txt"), self.table() + "\n")


def _make_op(
    op: str, size_bytes: int, n: int, device: torch.device, group: Optional[dist.ProcessGroup]
) -> Callable[[], None]:
    count = size_bytes // ELEMENT_BYTES
    if op == "all_reduce":
        buf = torch.ones(count, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        send, recv = torch.ones(count // n, device=device), torch.empty(count, device=device)
        return lambda: dist.all_gather_into_tensor(recv, send, group=group)
    if op == "reduce_scatter":
        send, recv = torch.ones(count, device=device), torch.empty(count // n, device=device)
        return lambda: dist.reduce_scatter_tensor(recv, send, group=group)
    if op == "all_to_all":
        send, recv = torch.ones(count, device=device), torch.empty(count, device=device)
        return lambda: dist.all_to_all_single(recv, send, group=group)
    if op == "broadcast":
        buf = torch.ones(count, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.broadcast(buf, src=src, group=group)
    raise ValueError(f"unknown collective '{op}'; known: {', '.join(OPS)}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(
    fn: Callable[[], None], iters: int, warmup: int, device: torch.device, group: Optional[dist.ProcessGroup]
) -> float:
    """Mean seconds per call on the slowest rank."""
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())


def run_bench(
    ops: Sequence[str] = OPS,
    sizes: Sequence[int] = (),
    iters: int = 20,
    warmup: int = 5,
    device: Optional[torch.device] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> BenchResult:
    """Time every op at every size on ``group`` (default: the whole world). Every rank returns the same result."""
    device = device or torch.device("cpu")
    n = dist.get_world_size(group)
    result = BenchResult(
        backend=str(dist.get_backend(group)), world_size=n, device=str(device), iters=iters, warmup=warmup
    )
    for op in ops:
        bus_factor(op, n)  # unknown op -> ValueError before any traffic
        for size in sizes or size_sweep(8, 2**20):
            size = aligned_size(size, n)
            t = time_op(_make_op(op, size, n, device, group), iters, warmup, device, group)
            t = max(t, 1e-9)
            result.rows.append(
                BenchRow(op, size, size // ELEMENT_BYTES, t * 1e6, algbw_gbps(size, t), busbw_gbps(op, size, t, n))
            )
    return result


def load_result(path: Path) -> BenchResult:
    data = json.loads(Path(path).read_text())
    data.pop("passed", None)
    rows = [BenchRow(**r) for r in data.pop("rows")]
    return BenchResult(rows=rows, **data)

"""Devices, thread pinning and peak FLOP/s.

Peak table: dense (no sparsity) vendor spec numbers in TFLOP/s, matched to the exact GPU by the name and the
memory ``torch.cuda.get_device_properties`` reports (:func:`match_gpu`); a GPU it does not know gets a measured
GEMM peak and a warning, never a near guess. For CPUs there is no honest spec
number, so the peak is *measured* once with a square GEMM at the run's thread count and dtype, and cached
in ``~/.cache/lmforge/cpu_peak.json`` keyed by CPU model, threads, dtype and torch version.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from lmforge.runtime import env_vars


@dataclass(frozen=True)
class GpuSpec:
    """One GPU product: how ``torch.cuda.get_device_properties`` names it, its memory, dense peaks by dtype."""

    kind: str
    tokens: Tuple[str, ...]  # every one of these occurs in the lower-cased device name
    excludes: Tuple[str, ...]  # none of these does
    memory_gib: Tuple[float, float]  # total_memory / 2**30 lies in [lo, hi]
    peaks: Dict[str, float]  # dense (no sparsity) TFLOP/s per dtype, from the vendor datasheet
    nominal_gib: float  # the datasheet memory, for the planner


# Dense TFLOP/s (the datasheets print "with sparsity" figures at 2x; these are half of those). Sources in
# docs/metrics.md ("GPU peak table").
GPU_SPECS: Tuple[GpuSpec, ...] = (
    GpuSpec(
        "h100_sxm",
        ("h100",),
        ("pcie", "nvl"),
        (70, 85),
        {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
        80.0,
    ),
    GpuSpec(
        "h100_pcie",
        ("h100", "pcie"),
        (),
        (70, 85),
        {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2},
        80.0,
    ),
    GpuSpec(
        "h100_nvl",
        ("h100", "nvl"),
        (),
        (85, 100),
        {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
        94.0,
    ),
    GpuSpec(
        "h200",
        ("h200",),
        ("nvl",),
        (130, 150),
        {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
        141.0,
    ),
    GpuSpec(
        "h200_nvl",
        ("h200", "nvl"),
        (),
        (130, 150),
        {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
        141.0,
    ),
    GpuSpec("a100_40gb", ("a100",), (), (35, 45), {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 40.0),
    GpuSpec("a100_80gb", ("a100",), (), (75, 85), {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}, 80.0),
    GpuSpec(
        "b200",
        ("b200",),
        (),
        (170, 200),
        {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 80.0},
        180.0,
    ),
    GpuSpec(
        "l40s",
        ("l40s",),
        (),
        (40, 50),
        {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6},
        48.0,
    ),
    GpuSpec(
        "mi300x",
        ("mi300x",),
        (),
        (180, 200),
        {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
        192.0,
    ),
)
# Short names accepted for planning (``cluster.device``): the common part of each family.
KIND_ALIASES = {"h100": "h100_sxm", "a100": "a100_80gb"}
_BY_KIND = {spec.kind: spec for spec in GPU_SPECS}
# Dense TFLOP/s and memory per device in GiB by kind (aliases included): what the planner looks up.
PEAK_TFLOPS: Dict[str, Dict[str, float]] = {
    **{s.kind: s.peaks for s in GPU_SPECS},
    **{a: _BY_KIND[k].peaks for a, k in KIND_ALIASES.items()},
}
DEVICE_MEMORY_GIB: Dict[str, float] = {
    **{s.kind: s.nominal_gib for s in GPU_SPECS},
    **{a: _BY_KIND[k].nominal_gib for a, k in KIND_ALIASES.items()},
}


def match_gpu(name: str, total_memory: int) -> Optional[GpuSpec]:
    """The one spec whose name tokens and memory range fit the device, else None (never a near guess)."""
    lowered = name.lower().replace("-", " ")
    gib = total_memory / 2**30
    hits = [
        s
        for s in GPU_SPECS
        if all(t in lowered for t in s.tokens)
        and not any(x in lowered for x in s.excludes)
        and s.memory_gib[0] <= gib <= s.memory_gib[1]
    ]
    return hits[0] if len(hits) == 1 else None


def select_device(preference: str = "auto", local_rank: int = 0) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but torch.cuda.is_available() is False; use train.device=cpu or auto")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def physical_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def threads_per_process(threads: int, local_world_size: int, cores: Optional[int] = None) -> int:
    """``train.threads`` when > 0, else ``cores`` (default: the CPUs this process may run on) / local ranks, at
    least 1: what each worker pins (``pin_threads``) and what the launchers export as ``OMP_NUM_THREADS``."""
    if threads > 0:
        return threads
    return max(1, (physical_cores() if cores is None else cores) // max(1, local_world_size))


def pin_threads(threads: int = 0, local_world_size: Optional[int] = None) -> int:
    """Set intra-op threads to ``threads_per_process`` (``train.threads``). Returns the count."""
    if local_world_size is None:
        local_world_size = env_vars.local_world_size()
    n = threads_per_process(threads, local_world_size)
    torch.set_num_threads(n)
    return n


def device_kind(device: torch.device) -> str:
    """``cpu``, the matched GPU kind (``h100_sxm``, ``a100_40gb``, ...), or the device's own name when unknown."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    spec = match_gpu(props.name, props.total_memory)
    return spec.kind if spec is not None else props.name


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype, n: int = 0, repeats: int = 5, best: bool = False
) -> float:
    """TFLOP/s of an n x n x n matmul on ``device`` after warm-up: the median of the repeats, or with
    ``best`` the fastest one (a *peak* should not be dragged down by a moment of contention)."""
    n = n or (4096 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        iters = 10 if device.type == "cuda" else 2
        for _ in range(iters):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append((time.perf_counter() - t0) / iters)
    return 2 * n**3 / (min(times) if best else statistics.median(times)) / 1e12


def _cpu_peak_cache(cache: Optional[Path]) -> Path:
    return cache or Path(env_vars.read("LMFORGE_CACHE") or Path.home() / ".cache" / "lmforge") / "cpu_peak.json"


def _cpu_peak_key(dtype: torch.dtype) -> str:
    # v2: best-of-repeats on 2048^3 (v1 took the median of 1024^3 and could cache a value measured under load).
    return f"v2|{cpu_model()}|threads={torch.get_num_threads()}|{dtype_key(dtype)}|torch={torch.__version__}"


def _read_table(cache: Path) -> dict:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}


def _write_table(cache: Path, table: dict) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, cache)
    except OSError:
        pass


def cpu_peak_tflops(dtype: torch.dtype = torch.float32, cache: Optional[Path] = None) -> float:
    """Measured (and cached) CPU GEMM peak at the current thread count."""
    cache, key = _cpu_peak_cache(cache), _cpu_peak_key(dtype)
    table = _read_table(cache)
    if key not in table:
        table[key] = measure_matmul_tflops(torch.device("cpu"), dtype, repeats=7, best=True)
        _write_table(cache, table)
    return float(table[key])


def refresh_cpu_peak(
    dtype: torch.dtype,
    achieved: float,
    *,
    peak: float,
    warn: Callable[[str], None] = print,
    cache: Optional[Path] = None,
) -> float:
    """A run achieved ``achieved`` TFLOP/s, above the cached CPU GEMM peak ``peak`` (measured while other work held
    the cores): measure it again, keep the higher figure in the cache, announce it in one line, return it."""
    cache, key = _cpu_peak_cache(cache), _cpu_peak_key(dtype)
    measured = measure_matmul_tflops(torch.device("cpu"), dtype, repeats=7, best=True)
    table = _read_table(cache)
    new = table[key] = max(measured, peak, float(table.get(key, 0.0)))  # another process may have cached more
    _write_table(cache, table)
    warn(
        f"lmforge: warning: the step ran at {achieved:.3f} TFLOP/s, above the cached CPU {dtype_key(dtype)} GEMM "
        f"peak of {peak:.3f} (measured under contention); re-measured: {measured:.3f}. MFU from now on uses "
        f"{new:.3f} ({cache})"
    )
    return new


def peak_tflops(device: torch.device, dtype: torch.dtype, warn: Callable[[str], None] = print) -> float:
    """Peak dense TFLOP/s per device for MFU: the spec of the exact GPU, a measured GEMM on CPU and on a GPU
    the table does not know (announced with one warning line)."""
    if device.type == "cpu":
        return cpu_peak_tflops(dtype)
    props = torch.cuda.get_device_properties(device)
    spec = match_gpu(props.name, props.total_memory)
    if spec is None:
        measured = measure_matmul_tflops(device, dtype, best=True)
        warn(
            f"lmforge: warning: GPU '{props.name}' ({props.total_memory / 2**30:.1f} GiB) is not in the peak table "
            f"(lmforge.runtime.hardware.GPU_SPECS); MFU uses a measured {dtype_key(dtype)} GEMM peak of "
            f"{measured:.1f} TFLOP/s. Fix: add the GPU's datasheet dense peak to GPU_SPECS"
        )
        return measured
    return spec.peaks.get(dtype_key(dtype), spec.peaks["bf16"])

"""Devices, thread pinning and peak FLOP/s.

Peak table: dense (no sparsity) vendor spec numbers in TFLOP/s. For CPUs there is no honest spec
number, so the peak is *measured* once with a square GEMM at the run's thread count and dtype, and cached
in ``~/.cache/lmforge/cpu_peak.json`` keyed by CPU model, threads, dtype and torch version.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

# Dense TFLOP/s by device kind and dtype (vendor specs, SXM parts where both exist).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "h100": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "l40s": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "a10g": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "mi300x": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "b200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 80.0},
}
# Memory per device in GiB.
DEVICE_MEMORY_GIB = {"h200": 141.0, "h100": 80.0, "a100": 80.0, "l40s": 48.0, "a10g": 24.0, "mi300x": 192.0, "b200": 192.0}
MEASURED_GPU_MATMUL_TFLOPS = {"h200": 790.0}  # bf16 4096^3 matmul rate measured on this project's H200


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


def pin_threads(threads: int = 0, local_world_size: Optional[int] = None) -> int:
    """Set intra-op threads: ``threads`` if > 0, else cores / local ranks (at least 1). Returns the count."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = threads if threads > 0 else max(1, physical_cores() // max(1, local_world_size))
    torch.set_num_threads(n)
    return n


def device_kind(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for kind in PEAK_TFLOPS:
        if kind in name.replace(" ", ""):
            return kind
    return name


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 0, repeats: int = 5,
                          best: bool = False) -> float:
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


def cpu_peak_tflops(dtype: torch.dtype = torch.float32, cache: Optional[Path] = None) -> float:
    """Measured (and cached) CPU GEMM peak at the current thread count."""
    cache = cache or Path(os.environ.get("LMFORGE_CACHE", Path.home() / ".cache" / "lmforge")) / "cpu_peak.json"
    # v2: best-of-repeats on 2048^3 (v1 took the median of 1024^3 and could cache a value measured under load).
    key = f"v2|{_cpu_model()}|threads={torch.get_num_threads()}|{dtype_key(dtype)}|torch={torch.__version__}"
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = measure_matmul_tflops(torch.device("cpu"), dtype, repeats=7, best=True)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, cache)
        except OSError:
            pass
    return float(table[key])


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak dense TFLOP/s per device for MFU: spec table on GPUs, measured GEMM on CPU."""
    if device.type == "cpu":
        return cpu_peak_tflops(dtype)
    kind = device_kind(device)
    table = PEAK_TFLOPS.get(kind)
    if table is None:
        return measure_matmul_tflops(device, dtype)
    return table.get(dtype_key(dtype), table["bf16"])

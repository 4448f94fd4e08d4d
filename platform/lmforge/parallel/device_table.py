"""Devices and links the step-time model (``lmforge.parallel.step_model``) plans on: how fast a device multiplies
matrices of a given shape, how fast it streams memory, and how fast its links move collectives.

**Peaks** are the dense (no sparsity) datasheet numbers of ``lmforge.runtime.hardware.PEAK_TFLOPS`` (NVIDIA A100,
H100, H200 and B200 datasheets; bf16 and fp8). **HBM bandwidth**, SM count and NVLink generation are from the
same datasheets and the architecture whitepapers: A100 80 GB SXM 2,039 GB/s (40 GB: 1,555 GB/s), 108 SMs,
NVLink 3; H100 SXM 3,350 GB/s, 132 SMs, NVLink 4; H200 4,800 GB/s, 132 SMs, NVLink 4; B200 8,000 GB/s,
148 SMs, NVLink 5; L40S 864 GB/s, 142 SMs, PCIe; MI300X 5,300 GB/s, 304 CUs, Infinity Fabric 7 x 64 GB/s
(NVIDIA A100 and H100 Tensor Core GPU Architecture whitepapers; H200, DGX B200, L40S and AMD Instinct MI300X
datasheets).

**GEMM efficiency by shape.** A GEMM of M x K by K x N takes

    max(2 M N K / (peak * gemm_peak_fraction * wave_efficiency), (M K + K N + M N) * bytes / HBM bandwidth)

``gemm_peak_fraction`` is the share of the peak that cuBLAS sustains on large bf16 GEMMs, as published by
GEMM sweeps outside any training run: A100 SXM 271 TFLOP/s (87%), H100 SXM 795 TFLOP/s (80%) in the
"maximum achievable matmul FLOPS" sweeps of S. Bekman's *Machine Learning Engineering* (compute/accelerator
chapter; MI300X 60% there); the H200 shares the H100's compute die (its bf16 GEMMs measure about 790 TFLOP/s), B200 at 75% from
the same sweeps' Blackwell figures. ``wave_efficiency`` is the tile/wave quantisation of NVIDIA's *Matrix
Multiplication Background User's Guide* (Deep Learning Performance documentation): the output is cut into
tiles (128 x 256 on Hopper/Blackwell, 128 x 128 on Ampere, the cuBLAS/CUTLASS bf16 defaults), one tile per SM
at a time, and a last partial wave of tiles leaves SMs idle: ``tiles / (ceil(tiles / SMs) * SMs)``. Each
kernel also pays ``kernel_overhead_s`` (launch and tail, a few microseconds).

**Attention** (flash-attention kernels) has its own sustained fractions of the peak, forward and backward,
from the FlashAttention-2 paper (Dao 2023, A100: ~ 60% forward, ~ 45% backward at head dim 128 with causal
masking) and FlashAttention-3 (Shah et al. 2024, H100: FA2 ~ 35% forward / 30% backward; PyTorch's SDPA
flash backend is FA2).

**Links** (``LINKS``): per-GPU unidirectional bandwidth, each with the share a large NCCL collective sustains
as bus bandwidth (nccl-tests ``busbw`` on DGX systems reaches about 80% of NVLink and 90% of InfiniBand line
rate). NVLink 3 300 GB/s, NVLink 4 450 GB/s, NVLink 5 900 GB/s per direction (NVLink datasheet); InfiniBand HDR
200 Gb/s, NDR 400 Gb/s, RoCE 200 and 400 Gb/s per NIC, one NIC per GPU (the DGX A100/H100/B200 rail layout).
A device's default inter-node link is its DGX system's: HDR for A100, NDR for H100, H200, B200.

**fp8**: float8 GEMMs sustain ``FP8_GEMM_PEAK_FRACTION`` of the fp8 peak (from torchao's Float8Linear
microbenchmark). **Power limits**: ``power_capped`` runs a Hopper part at a lower board power (its clock
interpolated between the H100 NVL and SXM datasheets). **Host time per op**: ``HOST_OP_OVERHEAD_GPU_S`` on GPUs,
measured on a CPU (``host_overhead``).

**In-step efficiency** (``IN_STEP_EFFICIENCY``): the share of those rates that kernels keep inside a training
step; the one parameter fitted to training runs, on a calibration subset of the published runs only (see
``lmforge.parallel.step_model``).

**GEMM rates by shape** (``DeviceSpec.gemm_shape_rates``, a CPU's only): where a GEMM's own shape was measured on
the machine (``device_spec('cpu', cpu_gemm_rates=...)``), it takes that rate instead of the large-GEMM rate and its
wave efficiency: a CPU runs thin GEMMs (K or N of 64 against 8,192) at 0.7-0.85 of its square-GEMM rate.

A measured GEMM rate (``cluster.gemm_tflops``) replaces ``peak * gemm_peak_fraction``; a ``lmforge comm bench``
JSON (``cluster.comm_bench``) replaces the bandwidth of the placement it measured (within a node when its
world fits in one node, across nodes otherwise).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional

from lmforge.comm.bench import load_result
from lmforge.config.errors import ConfigError
from lmforge.runtime.hardware import KIND_ALIASES, PEAK_TFLOPS


@dataclass(frozen=True)
class DeviceSpec:
    """What the step model needs of one device kind."""

    kind: str
    peak_tflops: Dict[str, float]  # dense TFLOP/s by dtype (bf16, fp8, fp32, ...)
    hbm_gbps: float  # memory bandwidth, GB/s (10^9 bytes/s)
    sms: int  # streaming multiprocessors (CPU: cores)
    tile: tuple  # (rows, cols) of one output tile of a GEMM kernel
    gemm_peak_fraction: float  # sustained share of the peak on large GEMMs
    attention_fraction: tuple  # (forward, backward) share of the peak for flash attention
    intra_link: str  # NVLink generation within a node
    inter_link: str  # default NIC per GPU across nodes
    kernel_overhead_s: float = 4e-6  # launch + tail per kernel
    measured_tflops: float = 0.0  # a measured GEMM rate (replaces peak * gemm_peak_fraction when > 0)
    in_step_efficiency: float = 1.0  # compute inside a training step relative to the kernels alone
    fp8_gemm_peak_fraction: float = 0.0  # sustained share of the fp8 peak on large float8 GEMMs (0: no fp8)
    op_overhead_s: float = 0.0  # host time to dispatch one ATen op (0: not counted)
    loss_rate: float = 0.0  # logits per second through the loss, forward + backward, where exp binds (CPU); 0: bytes
    host_async: bool = True  # the host dispatches ahead of the device (GPU): only host time beyond the kernels shows
    eager_elementwise: bool = False  # element-wise bytes as eager PyTorch moves them, op by op (CPU), not fused
    gemm_shape_rates: tuple = ()  # ((m, k, n), FLOP/s) measured for those shapes (CPU); others at gemm_rate

    def gemm_rate(self, dtype: str) -> float:
        """Sustained FLOP/s of a large GEMM in ``dtype``."""
        if self.measured_tflops > 0:
            return self.measured_tflops * 1e12 * (self._fp8_gain() if dtype == "fp8" else 1.0)
        if dtype == "fp8" and self.fp8_gemm_peak_fraction > 0:
            return self.peak(dtype) * self.fp8_gemm_peak_fraction
        return self.peak(dtype) * self.gemm_peak_fraction

    def _fp8_gain(self) -> float:
        """A float8 GEMM's sustained rate relative to a bf16 one (scales a measured bf16 rate)."""
        if self.fp8_gemm_peak_fraction <= 0 or self.peak("bf16") <= 0:
            return 1.0
        return self.peak("fp8") * self.fp8_gemm_peak_fraction / (self.peak("bf16") * self.gemm_peak_fraction)

    def shape_rate(self, m: int, k: int, n: int) -> float:
        """The measured FLOP/s of an M x K by K x N GEMM (0: not measured)."""
        for shape, rate in self.gemm_shape_rates:
            if shape == (m, k, n):
                return rate
        return 0.0

    def peak(self, dtype: str) -> float:
        table = self.peak_tflops
        return table.get(dtype, table.get("bf16", 0.0)) * 1e12


@dataclass(frozen=True)
class LinkSpec:
    name: str
    gbps: float  # per-GPU unidirectional bandwidth, GB/s
    efficiency: float  # share sustained as NCCL bus bandwidth on large messages
    latency_s: float  # per-step latency of a ring/tree hop

    @property
    def bus_gbps(self) -> float:
        return self.gbps * self.efficiency


LINKS: Dict[str, LinkSpec] = {
    "nvlink3": LinkSpec("nvlink3", 300.0, 0.80, 5e-6),
    "nvlink4": LinkSpec("nvlink4", 450.0, 0.80, 5e-6),
    "nvlink5": LinkSpec("nvlink5", 900.0, 0.80, 5e-6),
    "ib_hdr": LinkSpec("ib_hdr", 25.0, 0.90, 10e-6),
    "ib_ndr": LinkSpec("ib_ndr", 50.0, 0.90, 10e-6),
    "roce_200": LinkSpec("roce_200", 25.0, 0.85, 15e-6),
    "roce_400": LinkSpec("roce_400", 50.0, 0.85, 15e-6),
    "pcie4": LinkSpec("pcie4", 25.0, 0.80, 10e-6),
    "xgmi": LinkSpec("xgmi", 448.0, 0.70, 5e-6),
    "loopback": LinkSpec("loopback", 10.0, 1.0, 20e-6),  # CPU processes of one host (gloo: TCP over loopback)
}

# Compute inside a training step relative to the same kernels benchmarked alone: the one fitted parameter of the
# step model, fitted on the calibration sources only (Narayanan et al. 2021 and the llm-foundry MPT tables of
# published_runs.csv; ``python -m benchmarks.planner_validation --fit``), held out: every other source.
IN_STEP_EFFICIENCY = 0.83

# Host time per dispatched op on a GPU: eager PyTorch's frontend, dispatcher and autograd plus the kernel launch,
# "roughly 5 to 20 microseconds" per launch (factryze.ai, Tensor Core Throughput at Scale); the lower middle of that
# range. The host runs ahead of the GPU, so it shows only where the kernels are shorter (small models).
HOST_OP_OVERHEAD_GPU_S = 10e-6

# Float8 GEMMs (``torch._scaled_mm``, cuBLAS, tensorwise scales) sustain a smaller share of their doubled peak than
# bf16 GEMMs do: the share that reproduces torchao's H100 microbenchmark of a whole Float8Linear (forward and both
# backward GEMMs, dynamic scaling and casts included) against bf16 at M, K, N = 4096, 8192, 16384, a speedup of 1.39
# (torchao/float8/README.md, "Performance"), with ``step_model.FP8_CAST_BYTES`` for the casts
# (``tests/unit/test_step_model.py`` checks the derivation).
FP8_GEMM_PEAK_FRACTION = 0.66

_AMPERE = dict(sms=108, tile=(128, 128), attention_fraction=(0.60, 0.45), intra_link="nvlink3", inter_link="ib_hdr")
_HOPPER = dict(
    sms=132,
    tile=(128, 256),
    attention_fraction=(0.35, 0.30),
    intra_link="nvlink4",
    inter_link="ib_ndr",
    fp8_gemm_peak_fraction=FP8_GEMM_PEAK_FRACTION,
)
_BLACKWELL = dict(_HOPPER, sms=148, intra_link="nvlink5")

# kind -> (HBM GB/s, architecture parameters, large-GEMM share of the peak)
_GPUS = {
    "a100_80gb": (2039.0, _AMPERE, 0.87),
    "a100_40gb": (1555.0, _AMPERE, 0.87),
    "h100_sxm": (3350.0, _HOPPER, 0.80),
    "h100_pcie": (2000.0, dict(_HOPPER, sms=114, intra_link="pcie4"), 0.80),
    "h100_nvl": (3900.0, dict(_HOPPER, sms=132), 0.80),
    "h200": (4800.0, _HOPPER, 0.80),
    "h200_nvl": (4800.0, _HOPPER, 0.80),
    "b200": (8000.0, _BLACKWELL, 0.75),
    "l40s": (864.0, dict(_AMPERE, sms=142, intra_link="pcie4", inter_link="roce_200"), 0.70),
    "mi300x": (5300.0, dict(_HOPPER, sms=304, intra_link="xgmi", inter_link="roce_400"), 0.60),
}
GPU_KINDS = tuple(sorted(set(_GPUS) | {a for a, k in KIND_ALIASES.items() if k in _GPUS}))


def device_spec(
    kind: str,
    *,
    measured_tflops: float = 0.0,
    cpu_tflops: float = 0.0,
    cpu_gbps: float = 0.0,
    cpu_op_s: float = 0.0,
    cpu_loss_rate: float = 0.0,
    cpu_gemm_rates: Optional[Dict[tuple, float]] = None,
):
    """The spec of ``kind`` (aliases such as ``h100`` accepted); ``cpu`` needs its measured GEMM rate (and, for the
    host time of its ops, the measured seconds per dispatched op, ``host_overhead.measure_op_overhead``, for the
    loss its measured rate, ``host_overhead.measure_loss_rate``: a CPU's exp, not its memory, binds, and optionally
    the FLOP/s of the step's own GEMM shapes, ``{(m, k, n): rate}``)."""
    kind = KIND_ALIASES.get(kind, kind)
    if kind == "cpu":
        cores = os.cpu_count() or 1
        spec = DeviceSpec(
            kind="cpu",
            peak_tflops={"fp32": cpu_tflops, "bf16": cpu_tflops},
            hbm_gbps=cpu_gbps or 10.0,
            sms=cores,
            tile=(64, 64),
            gemm_peak_fraction=1.0,
            attention_fraction=(0.5, 0.5),
            intra_link="loopback",
            inter_link="loopback",
            kernel_overhead_s=0.0,
            measured_tflops=cpu_tflops,
            op_overhead_s=cpu_op_s,
            host_async=False,
            loss_rate=cpu_loss_rate,
            eager_elementwise=True,
            gemm_shape_rates=tuple(sorted((cpu_gemm_rates or {}).items())),
        )
    elif kind in _GPUS:
        hbm, arch, fraction = _GPUS[kind]
        spec = DeviceSpec(
            kind=kind,
            peak_tflops=PEAK_TFLOPS[kind],
            hbm_gbps=hbm,
            gemm_peak_fraction=fraction,
            in_step_efficiency=IN_STEP_EFFICIENCY,
            op_overhead_s=HOST_OP_OVERHEAD_GPU_S,
            **arch,
        )
    else:
        raise ConfigError(
            "cluster.device",
            f"the step-time model has no GEMM/bandwidth table for device '{kind}'",
            f"use one of: {', '.join(GPU_KINDS)}, cpu (or give cluster.gemm_tflops with a known kind)",
        )
    if measured_tflops > 0:
        spec = replace(spec, measured_tflops=measured_tflops)
    return spec


# Hopper's sustained tensor clock under a board power limit: the H100 NVL (350-400 W) and the H100 SXM (700 W)
# datasheets print 835.5 and 989.4 dense bf16 TFLOP/s for the same 132-SM die; between the two the clock is
# interpolated linearly in watts (``power_capped``).
HOPPER_POWER_POINTS = ((400.0, 835.5 / 989.4), (700.0, 1.0))


def power_capped(spec: DeviceSpec, watts: float, hbm_gbps: float = 0.0) -> DeviceSpec:
    """``spec`` (a 700 W Hopper part) run at a ``watts`` board power limit: every peak scaled by the clock the
    datasheets give at that power (``HOPPER_POWER_POINTS``), and, when given, another memory bandwidth."""
    (w0, s0), (w1, s1) = HOPPER_POWER_POINTS
    scale = s0 + (s1 - s0) * (min(max(watts, w0), w1) - w0) / (w1 - w0)
    peaks = {k: v * scale for k, v in spec.peak_tflops.items()}
    return replace(spec, peak_tflops=peaks, hbm_gbps=hbm_gbps or spec.hbm_gbps)


def link_spec(name: str) -> LinkSpec:
    if name not in LINKS:
        raise ConfigError("cluster", f"unknown link '{name}'", f"use one of: {', '.join(LINKS)}")
    return LINKS[name]


def wave_efficiency(spec: DeviceSpec, m: int, n: int) -> float:
    """Share of the SMs busy over a GEMM's waves of output tiles."""
    tiles = math.ceil(m / spec.tile[0]) * math.ceil(n / spec.tile[1])
    waves = math.ceil(tiles / spec.sms)
    return tiles / (waves * spec.sms)


def gemm_time(spec: DeviceSpec, m: int, k: int, n: int, *, dtype: str, bytes_per: int) -> float:
    """Seconds of one M x K by K x N GEMM (roofline of the shape-dependent rate and the bytes it moves)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    measured = spec.shape_rate(m, k, n) if spec.gemm_shape_rates and dtype != "fp8" else 0.0
    compute = 2.0 * m * n * k / (measured or spec.gemm_rate(dtype) * wave_efficiency(spec, m, n))
    memory = (m * k + k * n + m * n) * bytes_per / (spec.hbm_gbps * 1e9)
    return max(compute, memory) + spec.kernel_overhead_s


def memory_time(spec: DeviceSpec, n_bytes: float) -> float:
    """Seconds to stream ``n_bytes`` through device memory (element-wise and optimizer work)."""
    return n_bytes / (spec.hbm_gbps * 1e9)


@dataclass(frozen=True)
class Bandwidth:
    """A measured bus bandwidth curve: (message bytes, GB/s) points of one placement, from ``lmforge comm bench``."""

    points: tuple  # ((size_bytes, busbw_gbps), ...) sorted by size
    latency_s: float

    def gbps(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
            if size <= s1:
                w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return b0 + w * (b1 - b0)
        return pts[-1][1]


def bench_bandwidth(path: str, op: str = "all_reduce") -> Optional[tuple]:
    """(world size, Bandwidth) of one op of a ``lmforge comm bench`` JSON; refuses an unreadable file."""
    try:
        result = load_result(Path(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            "cluster.comm_bench",
            f"cannot read comm bench results {path}: {e}",
            "give a JSON `lmforge comm bench` wrote",
        ) from None
    rows = sorted(result.rows_of(op) or result.rows, key=lambda r: r.size_bytes)
    if not rows:
        raise ConfigError("cluster.comm_bench", f"{path} has no rows", "run `lmforge comm bench` again")
    points = tuple((r.size_bytes, max(r.busbw_gbps, 1e-9)) for r in rows)
    return result.world_size, Bandwidth(points, rows[0].time_us * 1e-6)

"""The step model's single-rank compute prediction beside measured CPU step times (docs/planner.md).

    python -m benchmarks.step_model_cpu [--models tiny bench_small gpt_125m] [--batch 0] [--repeats 3]

This CPU's own rates are measured first: a square fp32 ``torch.mm`` (2048^3, the median of 5 calls) is the
GEMM rate, and a 64 MiB tensor copy (read + write bytes) the memory bandwidth. The device table's ``cpu`` entry is
built from them (``device_table.device_spec('cpu', cpu_tflops=..., cpu_gbps=...)``: no in-step efficiency, no
network) and ``planner.make_plan`` predicts one step of each model at its micro batch (one rank, fp32). The
measurement is the median of ``--repeats`` timed steps (after one warm-up step) of a plain PyTorch loop over the
same ``GPT`` (forward, ``cross_entropy_loss``, backward, gradient clipping, fused AdamW), the loop of
``benchmarks/step.py``. Printed per model: predicted and measured step time, their ratio, and the prediction's
split (GEMMs vs the rest).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.step import bare_loop, base_overrides
from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.parallel.device_table import device_spec
from lmforge.parallel.planner import make_plan

# micro batch per model when --batch is 0: the presets' benchmark sizes (docs/performance.md), small enough for 2 cores
DEFAULT_BATCH = {"tiny": 8, "bench_small": 8, "gpt_125m": 1}


def gemm_tflops(n: int = 2048, calls: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e12


def copy_gbps(mib: int = 64, calls: int = 5) -> float:
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def measure_step(cfg, batch: int, repeats: int) -> float:
    step = bare_loop(cfg, batch)
    step()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["tiny", "bench_small", "gpt_125m"])
    ap.add_argument("--batch", type=int, default=0, help="micro batch (0: DEFAULT_BATCH per model)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tflops, gbps = gemm_tflops(), copy_gbps()
    print(
        f"cpu        {torch.get_num_threads()} threads: GEMM {tflops * 1e3:.1f} GFLOP/s (fp32 2048^3), copy {gbps:.1f} GB/s"
    )
    spec = device_spec("cpu", cpu_tflops=tflops, cpu_gbps=gbps)
    print(f"{'model':<12}{'batch':>6}{'predicted s':>13}{'measured s':>12}{'pred/meas':>11}{'GEMM share':>12}")
    for name in args.models:
        batch = args.batch or DEFAULT_BATCH.get(name, 1)
        overrides = base_overrides(name, batch) + ["cluster.device=cpu", "train.precision=fp32"]
        cfg = validate(compose(overrides), world_size=1)
        plan = make_plan(cfg, 1, peak=tflops, device=spec)
        measured = measure_step(cfg, batch, args.repeats)
        predicted = plan.step_time_s
        print(
            f"{name:<12}{batch:>6}{predicted:>13.4f}{measured:>12.4f}{predicted / measured:>11.2f}"
            f"{plan.step.gemm_share:>12.0%}",
            flush=True,
        )


if __name__ == "__main__":
    main()

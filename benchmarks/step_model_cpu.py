"""The step model's single-rank compute and gloo communication predictions beside measurements on this CPU.

    python -m benchmarks.step_model_cpu [--models tiny bench_small gpt_125m] [--batch 0] [--repeats 3]
                                        [--no-comm] [--json PATH]

This CPU's own rates are measured first: a square fp32 ``torch.mm`` (2048^3, the median of 5 calls) is the
GEMM rate, a 64 MiB tensor copy (read + write bytes) the memory bandwidth, and the host time per dispatched op
(``host_overhead.measure_op_overhead``). The device table's ``cpu`` entry is built from them
(``device_table.device_spec('cpu', cpu_tflops=..., cpu_gbps=..., cpu_op_s=...)``: no in-step efficiency) and
``planner.make_plan`` predicts one step of each model at its micro batch (one rank, fp32). The measurement is the
median of ``--repeats`` timed steps (after one warm-up step) of a plain PyTorch loop over the same ``GPT``
(forward, ``cross_entropy_loss``, backward, gradient clipping, fused AdamW), the loop of ``benchmarks/step.py``.
Printed per model: predicted and measured step time, their ratio, the prediction's host-dispatch part and its
GEMM share.

Communication: ``lmforge comm bench`` on 2 gloo ranks (torchrun, ``comm=cpu_gloo``) beside the step model's
collective time for the same op and size over the ``loopback`` link (``step_model.Group``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.step import bare_loop, base_overrides
from lmforge.comm.bench import load_result
from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.parallel.device_table import LINKS, device_spec
from lmforge.parallel.host_overhead import measure_op_overhead
from lmforge.parallel.planner import make_plan
from lmforge.parallel.step_model import Group

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-epyc-avx512" / "planner-cpu-check.json"
COMM_OPS = ("all_reduce", "all_gather")

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


def measured_spec():
    """The ``cpu`` device entry from this CPU's rates measured now: GEMM, copy bandwidth, host time per op."""
    tflops, gbps, op_s = gemm_tflops(), copy_gbps(), measure_op_overhead()
    print(
        f"cpu        {torch.get_num_threads()} threads: GEMM {tflops * 1e3:.1f} GFLOP/s (fp32 2048^3), copy {gbps:.1f} "
        f"GB/s, {op_s * 1e6:.1f} us per dispatched op"
    )
    return device_spec("cpu", cpu_tflops=tflops, cpu_gbps=gbps, cpu_op_s=op_s)


def compute_rows(models, batch_arg: int, repeats: int) -> list:
    """Per model: the rates measured right before its steps (a shared machine's load drifts), the prediction
    from them and the measured step."""
    rows = []
    for name in models:
        spec = measured_spec()
        print(
            f"{'model':<12}{'batch':>6}{'predicted s':>13}{'measured s':>12}{'pred/meas':>11}{'host s':>9}{'GEMM':>7}"
        )
        batch = batch_arg or DEFAULT_BATCH.get(name, 1)
        overrides = base_overrides(name, batch) + ["cluster.device=cpu", "train.precision=fp32"]
        cfg = validate(compose(overrides), world_size=1)
        plan = make_plan(cfg, 1, peak=spec.measured_tflops, device=spec)
        measured = measure_step(cfg, batch, repeats)
        predicted = plan.step_time_s
        print(
            f"{name:<12}{batch:>6}{predicted:>13.4f}{measured:>12.4f}{predicted / measured:>11.2f}"
            f"{plan.step.host_s:>9.4f}{plan.step.gemm_share:>7.0%}",
            flush=True,
        )
        rows.append(
            {
                "model": name,
                "micro_batch": batch,
                "predicted_s": predicted,
                "measured_s": measured,
                "ratio": predicted / measured,
                "host_s": plan.step.host_s,
                "gemm_share": plan.step.gemm_share,
                "gemm_gflops": spec.measured_tflops * 1e3,
                "copy_gbps": spec.hbm_gbps,
                "op_overhead_us": spec.op_overhead_s * 1e6,
            }
        )
    return rows


def comm_rows(max_bytes: str = "4M") -> list:
    """``lmforge comm bench`` on 2 gloo ranks beside the loopback link's prediction, per op and size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "lmforge.cli", "comm"]
        cmd += ["bench", "comm=cpu_gloo", "--device", "cpu", "--max-bytes", max_bytes, "--out", str(out)]
        cmd += ["--ops", ",".join(COMM_OPS)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        result = load_result(out)
    link = LINKS["loopback"]
    group = Group("gloo", result.world_size, False, link.bus_gbps, link.latency_s)
    print(f"{'op':<16}{'bytes':>10}{'predicted us':>14}{'measured us':>13}{'pred/meas':>11}")
    rows = []
    for op in COMM_OPS:
        for r in result.rows_of(op):
            predicted = getattr(group, op)(r.size_bytes) * 1e6
            print(f"{op:<16}{r.size_bytes:>10}{predicted:>14.1f}{r.time_us:>13.1f}{predicted / r.time_us:>11.2f}")
            rows.append({"op": op, "bytes": r.size_bytes, "predicted_us": predicted, "measured_us": r.time_us})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["tiny", "bench_small", "gpt_125m"])
    ap.add_argument("--batch", type=int, default=0, help="micro batch (0: DEFAULT_BATCH per model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no thread barriers on a loaded host)")
    ap.add_argument("--no-comm", action="store_true", help="skip the 2-rank gloo comm bench")
    ap.add_argument("--json", default=str(RESULTS), help="results JSON ('' for none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    compute = compute_rows(args.models, args.batch, args.repeats)
    comm = [] if args.no_comm else comm_rows()
    if args.json:
        record = {"threads": torch.get_num_threads(), "compute": compute, "comm": comm}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

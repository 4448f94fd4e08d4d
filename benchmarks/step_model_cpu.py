"""The step model's single-rank compute and gloo communication predictions beside measurements on this CPU.

    python -m benchmarks.step_model_cpu [--models tiny bench_small gpt_125m] [--batch 0] [--repeats 5]
                                        [--threads 1] [--no-comm] [--json PATH]

Each of ``--repeats`` timed steps (after one warm-up step) of a plain PyTorch loop over the same ``GPT`` (forward,
``cross_entropy_loss``, backward, gradient clipping, fused AdamW; the loop of ``benchmarks/step.py``) is paired
with this CPU's rates measured right before it, as a shared host's load drifts within seconds: a square fp32
``torch.mm`` (2048^3, the median of 5 calls) is the GEMM rate, a 64 MiB tensor copy (read + write bytes) the
memory bandwidth, ``host_overhead.measure_op_overhead`` the host time per dispatched op and
``host_overhead.measure_loss_rate`` the loss's rate (forward and backward, at the model's logits shape). The device table's ``cpu`` entry is built from them
(``device_table.device_spec('cpu', ...)``: no in-step efficiency) and ``planner.make_plan`` predicts the step
(one rank, fp32). Printed per model, for the pair at the median of predicted / measured: both step times, their
ratio, the prediction's host-dispatch seconds, its GEMM share and the rates of that moment.

Communication: ``lmforge comm bench`` on 2 gloo ranks (torchrun, ``comm=cpu_gloo``) beside the step model's
collective time for the same op and size over the ``loopback`` link (``step_model.Group``).
"""

from __future__ import annotations

import argparse
import json
import math
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
from lmforge.parallel.host_overhead import measure_loss_rate, measure_op_overhead
from lmforge.parallel.planner import make_plan
from lmforge.parallel.step_model import Group
from lmforge.runtime.hardware import cpu_model

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


def measured_spec(rows: int, vocab: int, quiet: bool = False):
    """The ``cpu`` device entry from this CPU's rates measured now: GEMM, copy bandwidth, host time per op and the
    loss's rate over ``rows x vocab`` logits (the step's)."""
    tflops, gbps, op_s = gemm_tflops(), copy_gbps(), measure_op_overhead()
    loss = measure_loss_rate(rows, vocab, repeats=3)
    if not quiet:
        print(
            f"cpu        {torch.get_num_threads()} threads: GEMM {tflops * 1e3:.1f} GFLOP/s (fp32 2048^3), copy "
            f"{gbps:.1f} GB/s, {op_s * 1e6:.1f} us per dispatched op, loss {loss / 1e9:.2f} G logits/s"
        )
    return device_spec("cpu", cpu_tflops=tflops, cpu_gbps=gbps, cpu_op_s=op_s, cpu_loss_rate=loss)


def paired_steps(cfg, batch: int, repeats: int, window_s: float = 0.5) -> list:
    """``repeats`` pairs of (the plan from the rates measured right before, the measured step): on a shared host
    the load drifts within seconds, so each step is held against the rates of its own moment. A step shorter than
    ``window_s`` is run back to back until the window is filled and the median taken: a single 50 ms step varies by
    half its length from one run to the next on this host."""
    step = bare_loop(cfg, batch)
    t0 = time.perf_counter()
    step()  # warm-up
    per_window = max(1, math.ceil(window_s / max(time.perf_counter() - t0, 1e-3)))
    pairs = []
    for _ in range(repeats):
        spec = measured_spec(batch * cfg.model.seq_len, cfg.model.vocab_size, quiet=True)
        plan = make_plan(cfg, 1, peak=spec.measured_tflops, device=spec)
        times = []
        for _ in range(per_window):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        pairs.append((plan, spec, statistics.median(times)))
    return pairs


def compute_rows(models, batch_arg: int, repeats: int) -> list:
    """Per model: the median over its paired steps of predicted / measured, and the pair at that median."""
    print(
        f"{'model':<12}{'batch':>6}{'predicted s':>13}{'measured s':>12}{'pred/meas':>11}{'host s':>9}{'GEMM':>6}"
        f"{'GFLOP/s':>9}{'us/op':>7}"
    )
    rows = []
    for name in models:
        batch = batch_arg or DEFAULT_BATCH.get(name, 1)
        overrides = base_overrides(name, batch) + ["cluster.device=cpu", "train.precision=fp32"]
        cfg = validate(compose(overrides), world_size=1)
        pairs = sorted(paired_steps(cfg, batch, repeats), key=lambda p: p[0].step_time_s / p[2])
        plan, spec, measured = pairs[len(pairs) // 2]
        predicted = plan.step_time_s
        print(
            f"{name:<12}{batch:>6}{predicted:>13.4f}{measured:>12.4f}{predicted / measured:>11.2f}"
            f"{plan.step.host_s:>9.4f}{plan.step.gemm_share:>6.0%}{spec.measured_tflops * 1e3:>9.1f}"
            f"{spec.op_overhead_s * 1e6:>7.1f}",
            flush=True,
        )
        rows.append(
            {
                "model": name,
                "micro_batch": batch,
                "predicted_s": predicted,
                "measured_s": measured,
                "ratio": predicted / measured,
                "ratios": [p.step_time_s / m for p, _, m in pairs],
                "host_s": plan.step.host_s,
                "gemm_share": plan.step.gemm_share,
                "gemm_gflops": spec.measured_tflops * 1e3,
                "copy_gbps": spec.hbm_gbps,
                "op_overhead_us": spec.op_overhead_s * 1e6,
                "loss_glogits_per_s": spec.loss_rate / 1e9,
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no thread barriers on a loaded host)")
    ap.add_argument("--no-comm", action="store_true", help="skip the 2-rank gloo comm bench")
    ap.add_argument("--json", default=str(RESULTS), help="results JSON ('' for none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    compute = compute_rows(args.models, args.batch, args.repeats)
    comm = [] if args.no_comm else comm_rows()
    if args.json:
        record = {
            "threads": torch.get_num_threads(),
            "cpu": cpu_model(),
            "load_at_start": load,
            "load_at_end": os.getloadavg()[0],
            "compute": compute,
            "comm": comm,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

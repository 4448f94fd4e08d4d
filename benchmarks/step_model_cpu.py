"""The step model's single-rank compute and gloo communication predictions beside measurements on this CPU.

    python -m benchmarks.step_model_cpu [--models tiny bench_small gpt_125m] [--batch 0] [--repeats 5]
                                        [--threads 1] [--no-comm] [--json PATH]

Each of ``--repeats`` timed steps (after one warm-up step) of a plain PyTorch loop over the same ``GPT`` (forward,
``cross_entropy_loss``, backward, gradient clipping, fused AdamW; the loop of ``benchmarks/step.py``) is paired
with this CPU's rates measured right before it: a square fp32 ``torch.mm`` (2048^3) is the GEMM rate, a 64 MiB
tensor copy (read + write bytes) the memory bandwidth, ``host_overhead.measure_op_overhead`` the host time per
dispatched op, ``host_overhead.measure_loss_rate`` the loss's rate (forward and backward, at the model's logits
shape), and every thin GEMM the step model times (a dimension of at most ``THIN_DIM``) at its own shape
(``shape_gflops``: a CPU runs them below its square rate). The device table's ``cpu`` entry is built from them
(``device_table.device_spec('cpu', ...)``: no in-step efficiency) and ``planner.make_plan`` predicts the step
(one rank, fp32).

Every time, of the step and of the rates, is the least disturbed one (``host_overhead.least_disturbed_s``): the
thread's CPU time (at one torch thread every kernel runs on it; the time other processes of a shared host hold the
core is not counted), the minimum of the repeats; a step shorter than ``window_s`` is repeated back to back until
the window is filled. Printed per model: the step predicted from the least-disturbed rates of all pairs (each rate
the best measured) beside the least-disturbed step of all windows, their ratio, the range of the single pairs'
ratios, the step's least wall time, the prediction's host-dispatch seconds, its GEMM share and the rates.

Communication: ``lmforge comm bench`` on 2 gloo ranks (torchrun, ``comm=cpu_gloo``) beside the step model's
collective time for the same op and size over the ``loopback`` link (``step_model.Group``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
from lmforge.parallel.device_table import LINKS, DeviceSpec, device_spec
from lmforge.parallel.host_overhead import least_disturbed_s, measure_loss_rate, measure_op_overhead
from lmforge.parallel.planner import make_plan
from lmforge.parallel.step_model import Group
from lmforge.runtime.hardware import cpu_model

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-epyc-avx512" / "planner-cpu-check.json"
COMM_OPS = ("all_reduce", "all_gather")

# micro batch per model when --batch is 0: the presets' benchmark sizes (docs/performance.md), small enough for 2 cores
DEFAULT_BATCH = {"tiny": 8, "bench_small": 8, "gpt_125m": 1}


# GEMMs with a dimension at most this wide are measured at their own shape: a CPU runs them below its square rate
THIN_DIM = 256


def gemm_tflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2.0 * n**3 / least_disturbed_s(lambda: torch.mm(a, b), repeats) / 1e12


def copy_gbps(mib: int = 64, repeats: int = 5) -> float:
    src = torch.empty(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / least_disturbed_s(lambda: dst.copy_(src), repeats) / 1e9


class _ShapeRecorder(DeviceSpec):
    """A device entry that records every GEMM shape the step model asks a rate for."""

    def shape_rate(self, m: int, k: int, n: int) -> float:
        self.gemm_shape_rates[0].add((m, k, n))
        return 0.0


def step_gemm_shapes(cfg, spec) -> list:
    """The (m, k, n) of every GEMM the step model times for ``cfg`` on ``spec`` with a dimension <= ``THIN_DIM``."""
    shapes: set = set()
    make_plan(cfg, 1, peak=spec.measured_tflops, device=_ShapeRecorder(**{**vars(spec), "gemm_shape_rates": (shapes,)}))
    return sorted(s for s in shapes if min(s) <= THIN_DIM)


def shape_gflops(m: int, k: int, n: int, repeats: int = 5) -> float:
    """FLOP/s of one M x K by K x N fp32 GEMM (``least_disturbed_s``, as the square rate is measured)."""
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    return 2.0 * m * k * n / least_disturbed_s(lambda: torch.mm(a, b, out=c), repeats)


def measured_spec(rows: int, vocab: int, cfg=None, quiet: bool = False):
    """The ``cpu`` device entry from this CPU's rates measured now: GEMM, copy bandwidth, host time per op, the
    loss's rate over ``rows x vocab`` logits (the step's) and, given ``cfg``, its thin GEMMs at their shapes."""
    tflops, gbps, op_s = gemm_tflops(), copy_gbps(), measure_op_overhead()
    loss = measure_loss_rate(rows, vocab, repeats=3)
    spec = device_spec("cpu", cpu_tflops=tflops, cpu_gbps=gbps, cpu_op_s=op_s, cpu_loss_rate=loss)
    shapes = {s: shape_gflops(*s) for s in step_gemm_shapes(cfg, spec)} if cfg is not None else {}
    if not quiet:
        print(
            f"cpu        {torch.get_num_threads()} threads: GEMM {tflops * 1e3:.1f} GFLOP/s (fp32 2048^3), copy "
            f"{gbps:.1f} GB/s, {op_s * 1e6:.1f} us per dispatched op, loss {loss / 1e9:.2f} G logits/s"
        )
    return device_spec(
        "cpu", cpu_tflops=tflops, cpu_gbps=gbps, cpu_op_s=op_s, cpu_loss_rate=loss, cpu_gemm_rates=shapes
    )


def paired_steps(cfg, batch: int, repeats: int, window_s: float = 0.5) -> list:
    """``repeats`` pairs of (the plan from the rates measured right before, the measured step's least CPU time,
    its least wall time): a step shorter than ``window_s`` is run back to back until the window is filled."""
    step = bare_loop(cfg, batch)
    t0 = time.perf_counter()
    step()  # warm-up
    per_window = max(1, math.ceil(window_s / max(time.perf_counter() - t0, 1e-3)))
    pairs = []
    for _ in range(repeats):
        spec = measured_spec(batch * cfg.model.seq_len, cfg.model.vocab_size, cfg, quiet=True)
        plan = make_plan(cfg, 1, peak=spec.measured_tflops, device=spec)
        cpu_s = wall_s = math.inf
        for _ in range(per_window):
            w0, c0 = time.perf_counter(), time.thread_time()
            step()
            cpu_s, wall_s = min(cpu_s, time.thread_time() - c0), min(wall_s, time.perf_counter() - w0)
        pairs.append((plan, spec, cpu_s, wall_s))
    return pairs


def least_disturbed_spec(specs: list):
    """The ``cpu`` entry of the least-disturbed rates of ``specs``: each rate the best any of them measured."""
    shapes: dict = {}
    for spec in specs:
        for shape, rate in spec.gemm_shape_rates:
            shapes[shape] = max(rate, shapes.get(shape, 0.0))
    return device_spec(
        "cpu",
        cpu_tflops=max(s.measured_tflops for s in specs),
        cpu_gbps=max(s.hbm_gbps for s in specs),
        cpu_op_s=min(s.op_overhead_s for s in specs),
        cpu_loss_rate=max(s.loss_rate for s in specs),
        cpu_gemm_rates=shapes,
    )


def compute_rows(models, batch_arg: int, repeats: int) -> list:
    """Per model: the step predicted from the least-disturbed rates of all pairs beside the least-disturbed step,
    and the ratios of the single pairs."""
    print(
        f"{'model':<12}{'batch':>6}{'predicted s':>13}{'measured s':>12}{'pred/meas':>11}{'pairs':>12}{'wall s':>9}"
        f"{'host s':>9}{'GEMM':>6}{'GFLOP/s':>9}{'thin':>6}{'us/op':>7}"
    )
    rows = []
    for name in models:
        batch = batch_arg or DEFAULT_BATCH.get(name, 1)
        overrides = base_overrides(name, batch) + ["cluster.device=cpu", "train.precision=fp32"]
        cfg = validate(compose(overrides), world_size=1)
        pairs = paired_steps(cfg, batch, repeats)
        ratios = sorted(plan.step_time_s / cpu_s for plan, _, cpu_s, _ in pairs)
        spec = least_disturbed_spec([p[1] for p in pairs])
        plan = make_plan(cfg, 1, peak=spec.measured_tflops, device=spec)
        measured, wall = min(p[2] for p in pairs), min(p[3] for p in pairs)
        predicted = plan.step_time_s
        thin = {f"{m}x{k}x{n}": rate / 1e9 for (m, k, n), rate in spec.gemm_shape_rates}
        print(
            f"{name:<12}{batch:>6}{predicted:>13.4f}{measured:>12.4f}{predicted / measured:>11.2f}"
            f"{f'{ratios[0]:.2f}-{ratios[-1]:.2f}':>12}{wall:>9.4f}{plan.step.host_s:>9.4f}{plan.step.gemm_share:>6.0%}"
            f"{spec.measured_tflops * 1e3:>9.1f}{len(thin):>6}{spec.op_overhead_s * 1e6:>7.1f}",
            flush=True,
        )
        rows.append(
            {
                "model": name,
                "micro_batch": batch,
                "predicted_s": predicted,
                "measured_s": measured,
                "measured_wall_s": wall,
                "ratio": predicted / measured,
                "pair_ratios": ratios,
                "host_s": plan.step.host_s,
                "gemm_share": plan.step.gemm_share,
                "gemm_gflops": spec.measured_tflops * 1e3,
                "thin_gemm_gflops": thin,
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

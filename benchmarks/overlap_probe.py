"""Cost of the overlap probe (comm/profiling.py) next to a training step, side by side.

    python -m benchmarks.overlap_probe [--model bench_small] [--batch 8] [--device cpu|cuda] [--repeats 5]

One process (gloo, a group of one): the engine step of ``--model``, and the same step under the probe as the
trainer runs a profiled step (``torch.profiler`` over the step, the Chrome trace exported, analysed and pruned),
interleaved by ``benchmarks.harness``. Prints the medians and the probe's extra time as a share of training time
at ``metrics.profile_every`` = the auto interval (``AUTO_PROFILE_EVERY``) and at 100. On the CPU the profiler
records every operator, so a small model with many small operators is the worst case; on a GPU it records
kernels. The all-gather of each rank's numbers to rank 0 (a few hundred bytes) is not in a group of one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import Case, one_process_engine, run_suite
from lmforge.runtime.hardware import pin_threads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench_small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    from lmforge.comm.profiling import AUTO_PROFILE_EVERY, OverlapProbe
    from lmforge.metrics.logger import MetricsLogger

    threads = pin_threads(args.threads)
    cfg, device, engine, MB = one_process_engine(args.model, args.batch, args.device)

    traces = Path(tempfile.mkdtemp(prefix="overlap-probe-"))
    probe, logger, steps = OverlapProbe(1, traces, device), MetricsLogger([]), iter(range(1, 10**9))

    def profiled() -> None:
        with probe.step(next(steps), logger):
            engine.train_step([MB], 1e-4)

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    tokens = args.batch * cfg.model.seq_len
    plain, probed = run_suite(
        f"overlap-probe-{args.model}-{args.device}",
        [
            Case(
                f"{args.model} step (batch {args.batch}x{cfg.model.seq_len})",
                lambda: engine.train_step([MB], 1e-4),
                tokens,
                "tokens",
            ),
            Case("the same step, profiled by the probe", profiled, tokens, "tokens"),
        ],
        repeats=args.repeats,
        warmup=1,
        sync=sync,
    )
    extra = max(0.0, probed.median_s - plain.median_s)
    trace_mb = max((p.stat().st_size for p in traces.glob("*.json")), default=0) / 2**20
    print(
        f"\nthreads={threads} device={device}: a profiled step costs {extra:.3f} s more than a plain one "
        f"({probed.median_s / plain.median_s:.2f}x; trace {trace_mb:.1f} MB, {len(list(traces.glob('*.json')))} kept); "
        f"as a share of training time at profile_every={AUTO_PROFILE_EVERY} (auto): "
        f"{extra / (AUTO_PROFILE_EVERY * plain.median_s):.3%}, at 100: {extra / (100 * plain.median_s):.2%}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

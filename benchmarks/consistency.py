"""Cost of the replica consistency check (fault/consistency.py) next to a training step, side by side.

    python -m benchmarks.consistency [--model gpt_125m] [--batch 1] [--device cpu|cuda] [--repeats 5]

One process: the engine step of ``--model`` and one ``ReplicaCheck.check`` of the same engine (fingerprints of
every parameter and AdamW moment, the all-gather over the replica group and the world all-reduce, here over a
group of one process, so the collectives carry a few KB and the fingerprint pass dominates), interleaved by
``benchmarks.harness``. Prints the medians and the check's cost as a share of step time at
``fault.consistency_every`` = 1000 (the default) and at 100.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from benchmarks.harness import Case, one_process_engine, run_suite
from lmforge.runtime.hardware import pin_threads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_125m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    from lmforge.fault.consistency import ReplicaCheck, named_state

    threads = pin_threads(args.threads)
    cfg, device, engine, MB = one_process_engine(args.model, args.batch, args.device, args.seq_len)

    engine.train_step([MB], 1e-4)  # AdamW state exists before the check is timed
    check = ReplicaCheck(1000, engine.inner, engine.optimizer, dist.group.WORLD, device)
    named = named_state(engine.inner, engine.optimizer)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    tokens = args.batch * cfg.model.seq_len
    results = run_suite(
        f"consistency-{args.model}-{args.device}",
        [
            Case(
                f"{args.model} engine step (batch {args.batch}x{cfg.model.seq_len})",
                lambda: engine.train_step([MB], 1e-4),
                tokens,
                "tokens",
            ),
            Case(
                f"replica check ({len(named)} tensors, {nbytes / 2**20:.0f} MiB)",
                lambda: check.check(1000),
                1,
                "checks",
            ),
        ],
        repeats=args.repeats,
        warmup=1,
        sync=sync,
    )
    step, chk = results
    print(
        f"\nthreads={threads} device={device}: check {chk.median_s * 1e3:.1f} ms = {chk.median_s / step.median_s:.2%} "
        f"of one step ({step.median_s:.3f} s); as a share of step time at consistency_every=1000: "
        f"{chk.median_s / (1000 * step.median_s):.4%}, at 100: {chk.median_s / (100 * step.median_s):.3%}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

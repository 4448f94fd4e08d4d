"""Checkpoint save/load time and async-save stall for gpt_125m on CPU, side by side in one process.

    python -m benchmarks.checkpoint [--repeats 2] [--tokens 512] [--dir /tmp/...]

Builds gpt_125m (fp32) with AdamW state (one real optimizer step), then through ``CheckpointManager``:
a synchronous save (``dcp.save``), a load, and async saves in thread and process mode. For async saves the
*stall* is the time ``save()`` blocks the training loop (copying the state to CPU staging buffers); the write
itself continues in the background and is committed after ``wait()``. The stall is compared with the time of
one training step of ``--tokens`` tokens measured in the same run (a real gpt_125m step at global batch
256 x 1024 tokens is ~500x longer, so the ratio printed here is a pessimistic upper bound).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.comm.process_group import init_process_group
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.comm import CommConfig
from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.model.gpt import GPT, cross_entropy_loss
from lmforge.optim.adamw import build_optimizer
from lmforge.runtime.hardware import pin_threads


def train_step(model, opt, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="tokens in the timed training step (one sequence)")
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir, removed after)")
    args = ap.parse_args()

    threads = pin_threads(0)
    init_process_group(CommConfig(), torch.device("cpu"))
    cfg = validate(compose(["model=gpt_125m"]))
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, cfg.model.vocab_size, (1, args.tokens + 1))
    train_step(model, opt, tokens)  # creates AdamW state (exp_avg, exp_avg_sq)
    step_s = statistics.median(train_step(model, opt, tokens) for _ in range(args.repeats))

    root = Path(args.dir or tempfile.mkdtemp(prefix="lmforge-ckpt-bench-"))
    rows = {}
    try:
        sync = CheckpointManager(root / "sync", CheckpointConfig(keep_last=1))
        times, loads = [], []
        for i in range(args.repeats):
            times.append(sync.save(i + 1, model, opt, {"world_size": 1}).stall_s)
            t0 = time.perf_counter()
            sync.load(sync.resolve("auto"), model, opt)
            loads.append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in sync.resolve("auto").iterdir()) / 2**30
        rows["sync save"] = (statistics.median(times), statistics.median(times))
        rows["load"] = (statistics.median(loads), None)
        for mode in ("thread", "process"):
            mgr = CheckpointManager(root / mode, CheckpointConfig(keep_last=1, async_mode=mode))
            stalls, totals = [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                stalls.append(mgr.save(i + 1, model, opt, {"world_size": 1}).stall_s)
                mgr.wait()
                totals.append(time.perf_counter() - t0)
            rows[f"async {mode}"] = (statistics.median(totals), statistics.median(stalls))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(
        f"gpt_125m: {n_params / 1e6:.1f}M params, checkpoint {size:.2f} GiB (model + AdamW, fp32), "
        f"{threads} threads, step of {args.tokens} tokens = {step_s:.2f} s (median of {args.repeats})"
    )
    print(f"{'operation':<14} {'total s':>9} {'stall s':>9} {'stall/step':>11}")
    for name, (total, stall) in rows.items():
        ratio = f"{stall / step_s:>10.1%}" if stall is not None else f"{'-':>10}"
        print(f"{name:<14} {total:>9.2f} {stall if stall is not None else float('nan'):>9.2f} {ratio}")
    stall_thread = rows["async thread"][1]
    print(f"async thread stall vs sync save: {stall_thread / rows['sync save'][0]:.2f}x of the blocking time")
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "params": n_params,
                "size_gib": size,
                "step_s": step_s,
                "step_tokens": args.tokens,
                "threads": threads,
                **{name.replace(" ", "_"): {"total_s": t, "stall_s": s} for name, (t, s) in rows.items()},
            }
        )
    )


if __name__ == "__main__":
    main()

"""Native FSDP2 (``parallelism=fsdp``) vs DeepSpeed ZeRO-3 (``parallelism=zero3``) on 2 data-parallel ranks:
tokens/s and peak memory per rank, and their ratios, from one invocation.

    python -m benchmarks.deepspeed_vs_fsdp [--model smoke|gpt_125m] [--steps 6] [--micro 4] [--seq-len 0]

Each engine runs in its own 2-rank launch (gloo on CPU, nccl on GPU; the same lmforge engines the trainer
uses), back to back, so peak memory is the engine's own: ``torch.cuda.max_memory_allocated`` on GPU, the
process's peak RSS on CPU. Step time is the median over ``--steps`` timed steps after 2 warm-up steps.
The engines are asked for ZeRO-3-equivalent sharding (FSDP2 reshard_after_forward=true).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.paths import scratch_path

ENGINES = {"native FSDP2": "parallelism=fsdp", "DeepSpeed ZeRO-3": "parallelism=zero3"}


def worker(args) -> None:
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.parallel.build_engine import build_engine
    from lmforge.runtime.hardware import select_device

    over = [
        f"model={args.model}",
        args.parallelism,
        f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.micro * 2}",
    ]
    if args.seq_len:
        over.append(f"model.seq_len={args.seq_len}")
    cfg = validate(compose(over), world_size=2)
    device = select_device(cfg.train.device, int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    init_process_group(cfg.comm, device)
    engine = build_engine(cfg, device)
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    tokens = torch.randint(0, cfg.model.vocab_size, (args.micro, cfg.model.seq_len + 1), generator=gen).to(device)

    class MB:
        def __init__(self):
            self.tokens, self.targets = tokens[:, :-1], tokens[:, 1:]
            self.positions = None  # no document masking (lmforge.data.loader.MicroBatch)

    times = []
    for i in range(args.steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        float(engine.train_step([MB()], 1e-4).loss)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out = {
        "median_s": statistics.median(times),
        "tokens_per_step": args.micro * 2 * cfg.model.seq_len,
        "peak_gib": peak,
        "device": str(device),
    }
    Path(args.out).write_text(json.dumps(out))


def launch(model: str, parallelism: str, steps: int, micro: int, seq_len: int) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-dsbench-"))
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.deepspeed_vs_fsdp",
            "--worker",
            "--model",
            model,
            "--steps",
            str(steps),
            "--micro",
            str(micro),
            "--seq-len",
            str(seq_len),
            "--parallelism",
            parallelism,
            "--out",
            str(tmp / f"rank{rank}.json"),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=open(tmp / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT)
        )
    for p in procs:
        p.wait(timeout=3600)
    results = []
    for rank in range(2):
        f = tmp / f"rank{rank}.json"
        if not f.exists():
            raise RuntimeError(f"{parallelism} rank {rank} failed:\n{(tmp / f'rank{rank}.log').read_text()[-3000:]}")
        results.append(json.loads(f.read_text()))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smoke")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--parallelism", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = {}
    for name, par in ENGINES.items():
        ranks = launch(args.model, par, args.steps, args.micro, args.seq_len)
        step = max(r["median_s"] for r in ranks)
        rows[name] = {
            "tokens_per_s": ranks[0]["tokens_per_step"] / step,
            "step_s": step,
            "peak_gib_per_rank": max(r["peak_gib"] for r in ranks),
            "device": ranks[0]["device"],
        }
    base = rows["native FSDP2"]
    print(
        f"\n== native FSDP2 vs DeepSpeed ZeRO-3, model={args.model}, 2 ranks, micro batch {args.micro}, "
        f"median of {args.steps} steps =="
    )
    print(f"{'engine':<20} {'step s':>8} {'tokens/s':>10} {'peak GiB/rank':>14} {'tok/s ratio':>12} {'mem ratio':>10}")
    for name, r in rows.items():
        print(
            f"{name:<20} {r['step_s']:>8.3f} {r['tokens_per_s']:>10,.0f} {r['peak_gib_per_rank']:>14.3f} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:>12.3f} {r['peak_gib_per_rank'] / base['peak_gib_per_rank']:>10.3f}"
        )
    out = scratch_path(f"deepspeed_vs_fsdp-{args.model}.json")
    out.write_text(
        json.dumps({"model": args.model, "micro": args.micro, "steps": args.steps, "results": rows}, indent=1)
    )


if __name__ == "__main__":
    main()

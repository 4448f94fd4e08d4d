"""Throughput of each parallel layout relative to the single-process run, measured side by side in one run.

    python -m benchmarks.parallel_layouts [--models smoke,gpt_125m] [--steps 6] [--layouts single,ddp,...]

For each model, every layout trains the same number of optimizer steps on the same global batch (random
token ids: throughput does not depend on their values) with real gloo ranks on this machine's cores; the
single-process run uses all cores, an N-rank layout cores/N threads per rank, so every row uses the same
hardware. Reported: the median step time over the measured steps (after warm-up), tokens/s and the ratio
to the single-process run of the same model, plus DDP with vs without gradient-reduction overlap.
Embeddings are untied for every layout (pipeline stages need it) so rows compare the same model.
Writes benchmarks/results/scratch/parallel_layouts.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.paths import scratch_path

# name -> (world size, parallelism overrides)
LAYOUTS: Dict[str, tuple] = {
    "single": (1, ["parallelism=single"]),
    "ddp": (2, ["parallelism=ddp"]),
    "ddp_no_overlap": (2, ["parallelism=ddp", "parallelism.overlap_grad_reduce=false"]),
    "fsdp": (2, ["parallelism=fsdp"]),
    "fsdp_zero2": (2, ["parallelism=fsdp_zero2"]),
    "tp2": (2, ["parallelism=tp2"]),
    "tp2_sp": (2, ["parallelism=tp2_sp"]),
    "pp2": (2, ["parallelism=pp2"]),
    "pp2_interleaved": (2, ["parallelism=pp2_interleaved"]),
    "pp2_zb": (2, ["parallelism=pp2_zb"]),
}
# model -> (overrides, micro batch, global batch)
MODELS: Dict[str, tuple] = {
    "smoke": (["model=smoke", "model.tie_embeddings=false"], 4, 16),
    "gpt_125m": (["model=gpt_125m", "model.tie_embeddings=false", "model.seq_len=256"], 2, 8),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, overrides: List[str], steps: int, warmup: int, threads: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from lmforge.comm.process_group import destroy_process_group, init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import check_batch, validate
    from lmforge.data.loader import MicroBatch
    from lmforge.parallel.native_engine import NativeEngine
    from lmforge.runtime.hardware import pin_threads

    pin_threads(max(1, threads // world) if threads else 0, world)
    cfg = validate(compose(overrides), world_size=world)
    device = torch.device("cpu")
    init_process_group(cfg.comm, device)
    engine = NativeEngine(cfg, device)
    plan = check_batch(cfg)
    g = torch.Generator().manual_seed(1000 + engine.dp_rank)
    T, m = cfg.model.seq_len, plan.micro_batch_size

    def batches():
        return [
            MicroBatch(
                torch.randint(0, cfg.model.vocab_size, (m, T), generator=g),
                torch.randint(0, cfg.model.vocab_size, (m, T), generator=g),
                [0] * m,
            )
            for _ in range(plan.grad_accum)
        ]

    times = []
    for _step in range(warmup + steps):
        data = batches()
        t0 = time.perf_counter()
        result = engine.train_step(data, 1e-4)
        float(result.loss)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(
            {"step_times": times[warmup:], "tokens_per_step": plan.tokens_per_step, "threads": torch.get_num_threads()}
        )
    destroy_process_group()


def run_layout(model: str, layout: str, steps: int, warmup: int, threads: int = 0) -> dict:
    world, par = LAYOUTS[layout]
    overrides, micro, global_batch = MODELS[model]
    overrides = (
        overrides
        + par
        + [
            "comm=cpu_gloo",
            "train.device=cpu",
            "train.precision=fp32",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={global_batch}",
        ]
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, overrides, steps, warmup, threads, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
    med = statistics.median(result["step_times"])
    return {
        "world": world,
        "median_step_s": med,
        "tokens_per_s": result["tokens_per_step"] / med,
        "threads_per_rank": result["threads"],
        **result,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smoke")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="total intra-op threads per layout (0: all cores)")
    ap.add_argument("--out", default=str(scratch_path("parallel_layouts.json")))
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    if "single" not in layouts:
        layouts = ["single"] + layouts
    report = {}
    for model in args.models.split(","):
        rows = {}
        for layout in layouts:
            rows[layout] = run_layout(model, layout, args.steps, args.warmup, args.threads)
            print(
                f"{model:9s} {layout:16s} ranks {rows[layout]['world']}  "
                f"median step {rows[layout]['median_step_s'] * 1e3:8.1f} ms  "
                f"{rows[layout]['tokens_per_s']:9.0f} tokens/s",
                flush=True,
            )
        base = rows["single"]["tokens_per_s"]
        for row in rows.values():
            row["ratio_vs_single"] = row["tokens_per_s"] / base
        report[model] = rows
    print("\nmodel     layout            ranks  tokens/s   vs single")
    for model, rows in report.items():
        for layout, row in rows.items():
            print(
                f"{model:9s} {layout:16s} {row['world']:5d} {row['tokens_per_s']:9.0f}   {row['ratio_vs_single']:6.2f}x"
            )
        if "ddp" in rows and "ddp_no_overlap" in rows:
            ratio = rows["ddp"]["tokens_per_s"] / rows["ddp_no_overlap"]["tokens_per_s"]
            print(f"{model:9s} DDP overlap vs no overlap: {ratio:.2f}x tokens/s")
            rows["ddp_overlap_speedup"] = ratio
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

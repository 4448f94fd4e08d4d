"""Expert parallelism on CPU: moe_smoke on 2 gloo ranks, FSDP dp_shard 2 with the experts sharded by FSDP (ep1)
vs split over the ranks with all-to-all token dispatch (ep2): step time and the all-to-all share of the ep2 step.

    python -m benchmarks.expert_parallel [--steps 5] [--batch 4] [--threads 1]

Each layout trains moe_smoke (fp32, one micro batch of ``--batch`` sequences of random token ids per rank and
step) through the real NativeEngine; the step time is the median over the measured steps after one warm-up.
The all-to-all time is the wall time rank 0 spends inside ``all_to_all_single`` (the counts, dispatch and
combine exchanges of every MoE layer, forward and backward: the blocking calls are timed, waiting for the
other rank included), summed per step. Writes benchmarks/results/scratch/expert_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.paths import scratch_path
from benchmarks.ranks import engine_on_rank, run_on_ranks

LAYOUTS: Dict[str, List[str]] = {"ep1": ["parallelism=fsdp"], "ep2": ["parallelism=fsdp", "parallelism.ep=2"]}


def _rank(rank: int, world: int, port: int, overrides: List[str], steps: int, threads: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from lmforge.comm.process_group import destroy_process_group
    from lmforge.data.loader import MicroBatch

    cfg, engine = engine_on_rank(rank, world, port, overrides, threads)
    spent = [0.0]
    exchange = dist.all_to_all_single

    def timed_all_to_all(*args, **kwargs):  # the benchmark's probe: the blocking exchange's wall time
        t0 = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    dist.all_to_all_single = timed_all_to_all
    g = torch.Generator().manual_seed(7 + rank)  # each data-parallel rank its own rows
    B, T, V = cfg.train.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    tokens, targets = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    times, a2a = [], []
    for _ in range(1 + steps):
        spent[0] = 0.0
        t0 = time.perf_counter()
        float(engine.train_step([MicroBatch(tokens, targets, [0] * B)], 1e-4).loss)
        times.append(time.perf_counter() - t0)
        a2a.append(spent[0])
    if rank == 0:
        queue.put({"step_times": times[1:], "all_to_all_times": a2a[1:], "threads": torch.get_num_threads()})
    destroy_process_group()


def run(layout: str, steps: int, batch: int, threads: int) -> dict:
    overrides = [
        "model=moe_smoke",
        *LAYOUTS[layout],
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.precision=fp32",
        f"train.micro_batch_size={batch}",
        f"train.global_batch_size={2 * batch}",
    ]
    result = run_on_ranks(_rank, 2, (overrides, steps, threads), layout)
    step = statistics.median(result["step_times"])
    share = statistics.median(a / s for a, s in zip(result["all_to_all_times"], result["step_times"]))
    return {"median_step_s": step, "all_to_all_share": share, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--out", default=str(scratch_path("expert_parallel.json")))
    args = ap.parse_args()
    rows = {layout: run(layout, args.steps, args.batch, args.threads) for layout in LAYOUTS}
    for layout, row in rows.items():
        print(
            f"moe_smoke 2 ranks {layout}: step {row['median_step_s'] * 1e3:8.0f} ms (median of {args.steps}), "
            f"all-to-all {row['all_to_all_share']:.1%} of the step",
            flush=True,
        )
    print(
        f"all-to-all share of step at ep2: {rows['ep2']['all_to_all_share']:.1%}; ep2 step / ep1 step "
        f"{rows['ep2']['median_step_s'] / rows['ep1']['median_step_s']:.2f}x"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"batch": args.batch, "steps": args.steps, "layouts": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Measured side by side: DDP with bucketed gradient all-reduce (overlapped with backward) vs one all-reduce
after backward, on 2 real gloo ranks with the tiny GPT and the same synthetic batches.

    python -m benchmarks.comm_overlap [--steps 12] [--profile-every 3] [--micro-batch 8] [--bucket-mb 1]

For each mode it prints the median unprofiled step time and the overlap numbers of ``lmforge.comm.overlap``
(median over the profiled steps and ranks), then the ratios; ``--json PATH`` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List


def _rank(rank: int, world: int, port: int, overlap: bool, args: dict, out: str) -> None:
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
    from lmforge.comm.profiling import OverlapProbe
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.loader import MicroBatch
    from lmforge.parallel.native_engine import NativeEngine

    torch.set_num_threads(1)
    cfg = validate(
        compose(
            [
                "model=tiny",
                "parallelism=ddp",
                "comm=cpu_gloo",
                f"parallelism.overlap_grad_reduce={overlap}",
                f"parallelism.ddp_bucket_cap_mb={args['bucket_mb']}",
                "train.global_batch_size=16",
            ]
        ),
        world_size=world,
    )
    device = torch.device("cpu")
    init_process_group(cfg.comm, device)
    engine = NativeEngine(cfg, device)
    g = torch.Generator().manual_seed(100 + rank)
    T, m = cfg.model.seq_len, args["micro_batch"]
    batches = [
        MicroBatch(
            tokens=torch.randint(0, 8000, (m, T), generator=g),
            targets=torch.randint(0, 8000, (m, T), generator=g),
            source_ids=[0] * m,
        )
        for _ in range(args["steps"])
    ]
    records: List[dict] = []

    class Collect:
        def log(self, record: dict) -> None:
            records.append(record)

    probe = OverlapProbe(args["profile_every"], Path(out) / f"traces-{overlap}", device)
    times = []
    for step in range(1, args["steps"] + 1):
        t0 = time.perf_counter()
        with probe.step(step, Collect()):
            engine.train_step([batches[step - 1]], 1e-4)
        if not probe.due(step) and step > 1:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out, f"result-{overlap}.json").write_text(json.dumps({"times": times, "records": records}))
    destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profile-every", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--bucket-mb", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows and ratios to this JSON file")
    a = p.parse_args(argv)
    args = {"steps": a.steps, "profile_every": a.profile_every, "micro_batch": a.micro_batch, "bucket_mb": a.bucket_mb}
    import socket

    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="lmforge-overlap-bench-")
    rows = {}
    for overlap in (True, False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(2, port, overlap, args, out), nprocs=2, join=True, start_method="spawn")
        res = json.loads(Path(out, f"result-{overlap}.json").read_text())
        recs = res["records"]
        rows[overlap] = {
            "step_ms": statistics.median(res["times"]) * 1e3,
            "overlap_fraction": statistics.median(r["comm/overlap_fraction"] for r in recs),
            "comm_ms": statistics.median(r["comm/total_ms"] for r in recs),
            "exposed_ms": statistics.median(r["comm/exposed_ms"] for r in recs),
            "profiled_steps": len(recs),
        }
    print(f"{'mode':<34}{'step ms':>10}{'comm ms':>10}{'exposed ms':>12}{'overlap':>10}")
    for overlap, name in ((True, "DDP buckets (overlap_grad_reduce)"), (False, "all-reduce after backward")):
        r = rows[overlap]
        print(
            f"{name:<34}{r['step_ms']:>10.1f}{r['comm_ms']:>10.1f}{r['exposed_ms']:>12.1f}{r['overlap_fraction']:>10.3f}"
        )
    ratio = rows[False]["step_ms"] / rows[True]["step_ms"]
    exp_ratio = rows[False]["exposed_ms"] / max(rows[True]["exposed_ms"], 1e-9)
    print(f"step time ratio (after-backward / bucketed): {ratio:.2f}x; exposed comm ratio: {exp_ratio:.2f}x")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "args": args,
                    "rows": {str(k): v for k, v in rows.items()},
                    "step_time_ratio": ratio,
                    "exposed_ratio": exp_ratio,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

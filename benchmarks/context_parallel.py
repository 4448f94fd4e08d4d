"""Context parallelism on CPU: activation memory per rank and step time against sequence length, cp1 vs cp2
(2 gloo ranks), ring vs all-gather K/V exchange.

    python -m benchmarks.context_parallel [--model smoke] [--seq-lens 512,1024,2048,4096] [--steps 3]

Each row trains the same model (untied embeddings, fp32, micro batch 1, one sequence per step) through the
real NativeEngine on random token ids. Activation memory per rank is what autograd keeps for backward at the
end of one forward (every tensor saved through ``torch.autograd.graph.saved_tensors_hooks``, counted once per
storage, weights excluded), measured on rank 0; the step time is the median over the measured steps after one
warm-up step, with ``--threads`` intra-op threads per rank (default 1, so cp2 uses two cores where cp1 uses
one: the step-time ratio is what a second device buys, net of the exchange). Writes
benchmarks/results/scratch/context_parallel.json.
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

LAYOUTS: Dict[str, tuple] = {  # name -> (world size, overrides)
    "cp1": (1, ["parallelism=single"]),
    "cp2_ring": (2, ["parallelism=cp2", "parallelism.cp_kv_exchange=ring"]),
    "cp2_allgather": (2, ["parallelism=cp2", "parallelism.cp_kv_exchange=allgather"]),
}


def _storage(t):
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def weight_storages(engine) -> set:
    """Storages of the weights (sharded parameters and FSDP2's gathered copies): state, not activations."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ptrs = {_storage(p).data_ptr() for p in engine.inner.parameters()}
    for module in engine.inner.modules():
        if isinstance(module, FSDPModule):
            for group in fully_shard.state(module)._fsdp_param_groups:
                for fp in group.fsdp_params:
                    unsharded = getattr(fp, "_unsharded_param", None)
                    if unsharded is not None:
                        ptrs.add(_storage(unsharded).data_ptr())
    return ptrs


def saved_activation_bytes(engine, tokens, targets) -> int:
    """Bytes autograd holds for backward at the end of one forward of (tokens, targets): distinct storages,
    weights excluded."""
    import torch

    storages: Dict[int, object] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = _storage(t)
            storages[s.data_ptr()] = s
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine.forward_loss(tokens, targets)
    weights = weight_storages(engine)
    total = sum(s.nbytes() for ptr, s in storages.items() if ptr not in weights)
    loss.backward()
    engine.optimizer.zero_grad(set_to_none=True)
    return total


def _rank(rank: int, world: int, port: int, overrides: List[str], steps: int, threads: int, queue) -> None:
    import torch

    from lmforge.comm.process_group import destroy_process_group
    from lmforge.data.loader import MicroBatch

    cfg, engine = engine_on_rank(rank, world, port, overrides, threads)
    g = torch.Generator().manual_seed(7)  # the same sequence on every cp rank (one data-parallel group)
    T, V = cfg.model.seq_len, cfg.model.vocab_size
    tokens, targets = torch.randint(0, V, (1, T), generator=g), torch.randint(0, V, (1, T), generator=g)
    activations = saved_activation_bytes(engine, tokens, targets)
    times = []
    for _ in range(1 + steps):
        t0 = time.perf_counter()
        float(engine.train_step([MicroBatch(tokens, targets, [0])], 1e-4).loss)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put({"activation_bytes": activations, "step_times": times[1:], "threads": torch.get_num_threads()})
    destroy_process_group()


def run(model: str, layout: str, seq_len: int, steps: int, threads: int) -> dict:
    world, par = LAYOUTS[layout]
    overrides = [
        f"model={model}",
        "model.tie_embeddings=false",
        f"model.seq_len={seq_len}",
        *par,
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.precision=fp32",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
    ]
    result = run_on_ranks(_rank, world, (overrides, steps, threads), f"{layout} seq_len {seq_len}")
    return {"world": world, "median_step_s": statistics.median(result["step_times"]), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smoke")
    ap.add_argument("--seq-lens", default="512,1024,2048,4096")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per rank (default 1: on a shared machine, OpenMP teams on oversubscribed "
        "cores stall; 0: the cores split evenly between the ranks)",
    )
    ap.add_argument("--out", default=str(scratch_path("context_parallel.json")))
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    if "cp1" not in layouts:
        layouts = ["cp1"] + layouts
    report: Dict[str, dict] = {}
    print(f"{args.model}: seq_len  layout         activations/rank   vs cp1   step (median)   vs cp1")
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        rows = {layout: run(args.model, layout, seq_len, args.steps, args.threads) for layout in layouts}
        base = rows["cp1"]
        for layout, row in rows.items():
            row["memory_vs_cp1"] = row["activation_bytes"] / base["activation_bytes"]
            row["step_vs_cp1"] = row["median_step_s"] / base["median_step_s"]
            print(
                f"{'':8s}{seq_len:7d}  {layout:14s} {row['activation_bytes'] / 2**20:10.1f} MiB  "
                f"{row['memory_vs_cp1']:6.2f}x  {row['median_step_s'] * 1e3:10.0f} ms  {row['step_vs_cp1']:6.2f}x",
                flush=True,
            )
        report[str(seq_len)] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "rows": report}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""MoE step throughput: moe_smoke (8 experts of width 384, top-2) vs the dense smoke model of equal active
FLOPs per token (d_ff = 2 x 384 = 768), the grouped vs loop expert compute, and both compiled; the engine's full step
(forward, backward with the router losses, clipping, AdamW, the bias update), interleaved repeats, medians, the
ratio to the dense case.

    python -m benchmarks.moe [--batch 8] [--repeats 5] [--threads 0]

One function per case (``CASES``): each returns the overrides of its run; ``main`` composes, builds and times
them side by side. Expert parallelism (the all-to-all share of the step at ep2, a multi-process measurement) is
measured by ``benchmarks/expert_parallel.py``.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List

from benchmarks.harness import Case, run_suite
from benchmarks.step import engine_step
from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.model.flops import flops_per_token
from lmforge.model.gpt import param_count_from_config
from lmforge.runtime.hardware import pin_threads


def dense_equal_active() -> List[str]:
    """The baseline: the dense smoke model whose FFN is as wide as moe_smoke's two active experts together
    (3*d*768 = top-2 of 3*d*384; the router adds 0.3%)."""
    return ["model=smoke", "model.d_ff=768"]


def moe_smoke_loop() -> List[str]:
    """moe_smoke with the per-expert loop (what ``compute=auto`` runs on CPU)."""
    return ["model=moe_smoke", "model.moe.compute=loop"]


def moe_smoke_grouped() -> List[str]:
    """moe_smoke with one ``torch._grouped_mm`` call per projection (``compute=auto`` on CUDA)."""
    return ["model=moe_smoke", "model.moe.compute=grouped"]


def dense_equal_active_compiled() -> List[str]:
    """The dense baseline with ``parallelism.compile=true`` (the compile happens in the harness's warm-up)."""
    return dense_equal_active() + ["parallelism.compile=true"]


def moe_smoke_loop_compiled() -> List[str]:
    """moe_smoke compiled: the blocks traced except the expert compute (docs/model.md, MoE and torch.compile)."""
    return moe_smoke_loop() + ["parallelism.compile=true"]


CASES: Dict[str, Callable[[], List[str]]] = {
    "dense smoke d_ff=768 (equal active FLOPs)": dense_equal_active,
    "moe_smoke loop (compute=auto on CPU)": moe_smoke_loop,
    "moe_smoke grouped (torch._grouped_mm)": moe_smoke_grouped,
    "dense smoke d_ff=768 compiled": dense_equal_active_compiled,
    "moe_smoke loop compiled": moe_smoke_loop_compiled,
    # "moe_smoke ep2 ...": the all-to-all share at ep2 (its own launch), added with parallelism.ep
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    batch = [f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}"]
    cases, fpt = [], {}
    for name, overrides_of in CASES.items():
        overrides = overrides_of() + batch
        cfg = validate(compose(overrides), world_size=1)
        fpt[name] = (flops_per_token(cfg.model), param_count_from_config(cfg.model))
        cases.append(Case(name, engine_step(overrides, args.batch), args.batch * cfg.model.seq_len, "tokens"))
    results = run_suite("moe-step", cases, repeats=args.repeats, baseline=next(iter(CASES)))
    print(f"\nthreads={threads}")
    for r in results:
        flops, params = fpt[r.name]
        print(
            f"  {r.name:<44} {r.rate:10,.0f} tok/s  flops/token {flops:,}  params {params:,}  "
            f"{r.rate * flops / 1e12:.3f} TFLOP/s"
        )


if __name__ == "__main__":
    main()

"""MoE step throughput: moe_smoke (8 experts of width 384, top-2) vs the dense smoke model of equal active
FLOPs per token (d_ff = 2 x 384 = 768), and the grouped vs loop expert compute; the engine's full step
(forward, backward with the router losses, clipping, AdamW, the bias update), interleaved repeats.

    python -m benchmarks.moe [--batch 8] [--repeats 5] [--threads 0]

Expert parallelism (the all-to-all share of the step at ep2) is measured by ``benchmarks/expert_parallel.py``.
"""
from __future__ import annotations

import argparse

from benchmarks.harness import Case, run_suite
from benchmarks.step import engine_step
from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.model.flops import flops_per_token
from lmforge.model.gpt import param_count_from_config
from lmforge.runtime.hardware import pin_threads

DENSE_EQUAL_ACTIVE = ["model=smoke", "model.d_ff=768"]  # 3*d*768 = top-2 of 3*d*384 (router: +0.3%)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    batch = [f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}"]
    variants = {
        "dense smoke d_ff=768 (equal active FLOPs)": DENSE_EQUAL_ACTIVE,
        "moe_smoke grouped (torch._grouped_mm)": ["model=moe_smoke", "model.moe.compute=grouped"],
        "moe_smoke loop": ["model=moe_smoke", "model.moe.compute=loop"],
    }
    cases, fpt = [], {}
    for name, overrides in variants.items():
        cfg = validate(compose(overrides + batch), world_size=1)
        tokens = args.batch * cfg.model.seq_len
        fpt[name] = (flops_per_token(cfg.model), param_count_from_config(cfg.model))
        cases.append(Case(name, engine_step(overrides + batch, args.batch), tokens, "tokens"))
    results = run_suite("moe-step", cases, repeats=args.repeats, baseline=next(iter(variants)))
    print(f"\nthreads={threads}")
    for r in results:
        flops, params = fpt[r.name]
        print(f"  {r.name:<44} {r.rate:10,.0f} tok/s  flops/token {flops:,}  params {params:,}  "
              f"{r.rate * flops / 1e12:.3f} TFLOP/s")


if __name__ == "__main__":
    main()

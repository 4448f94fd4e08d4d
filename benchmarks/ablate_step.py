"""What each part of an eager training step costs, measured without a profiler: the step with that part taken
out, interleaved with the whole step, and the paired difference.

    python -m benchmarks.ablate_step [--model bench_small] [--batch 8] [--repeats 9] [--threads 0]
                                     [--host-malloc retain|system]

``benchmarks/profile_step.py`` reads each op's own time from ``torch.profiler``, which disturbs what it measures
on a CPU: in a bench_small step torch's tanh-GELU took 8.3 ms a call profiled and about 3 ms unprofiled, and the
profiler's own small allocations split the heap blocks that ``train.host_malloc=retain`` keeps for the next step
(benchmarks/reports/2026-12-step-speed.md). Here each case is the real engine step (``NativeEngine.train_step``)
with one part swapped for a stand-in that keeps every GEMM (so the GEMM work is the same in every case: checked in
``tests/unit/test_ablate_step.py``):

- ``attention``: SDPA -> ``q + k + v`` (K/V broadcast over the query heads of a group): gradients still reach
  wq, wk and wv;
- ``activation``: the FFN's nonlinearity (tanh-GELU, or SwiGLU's SiLU) -> nothing (SwiGLU keeps its product);
- ``RoPE``: -> nothing;
- ``norms``: LayerNorm / RMSNorm -> nothing;
- ``loss``: the chunked cross-entropy -> a loss whose backward only writes a dense logits gradient, the floor
  any loss pays (so the figure is the loss's cost above that floor);
- ``clipping``: the global gradient norm and the clip -> nothing;
- ``optimizer``: the fused AdamW step -> nothing;
- ``all of the above`` at once: what is left is the GEMMs, the embedding, the residual adds, autograd and the
  engine; it is put against the fp32 GEMM probe of the same shapes (``benchmarks/step.py``'s), so the rest of
  that case is the step's work around its GEMMs plus the GEMMs' own in-step slowdown.

A part's cost is the median over rounds of (whole step - step without it), in ms and as a share of the whole
step. The shares need not add up to the whole: parts interact (a norm's output feeds a GEMM's cache).
Eager only: a compiled step would recompile for every stand-in.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
from typing import Callable, Dict, Iterator, List

import torch
from torch import nn

from benchmarks.harness import Case, add_host_malloc_flag, run_suite
from lmforge.runtime import host_memory


class _LossFloor(torch.autograd.Function):
    """A stand-in loss: no forward work; its backward writes a dense gradient of the logits (what every loss's
    backward must), a constant ``grad / rows``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        ctx.logits_meta = (logits.shape, logits.dtype, logits.device)
        return torch.zeros((), dtype=torch.float32, device=logits.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.logits_meta
        return torch.full(shape, float(grad) / shape[0], dtype=dtype, device=device)


def _attention_sum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
    b, h, t, d = q.shape
    kv = (k + v).unsqueeze(2)  # [B, H_kv, 1, T, D], broadcast over the query heads of each group
    return (q.view(b, k.shape[1], h // k.shape[1], t, d) + kv).view(b, h, t, d)


def _ffn_without_activation(self, x: torch.Tensor) -> torch.Tensor:
    if self.gated:
        return self.w2(self.w1(x) * self.w3(x))
    return self.w2(self.w1(x))


def _clip_nothing(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    return torch.zeros(())


def _identity_module(self, x: torch.Tensor) -> torch.Tensor:
    return x


@functools.lru_cache(maxsize=None)
def stand_ins() -> Dict[str, List[tuple]]:
    """Each ablation: the (object, attribute, stand-in) triples it swaps while a step runs (built once: ``ablated``
    runs inside every timed call)."""
    from lmforge.model import feed_forward, gpt
    from lmforge.parallel import native_engine

    return {
        "attention": [(gpt.Attention, "attend", staticmethod(_attention_sum))],
        "activation": [(feed_forward.FeedForward, "forward", _ffn_without_activation)],
        "RoPE": [(gpt, "apply_rope", lambda x, cos, sin: x)],
        "norms": [(nn.LayerNorm, "forward", _identity_module), (nn.RMSNorm, "forward", _identity_module)],
        "loss": [(native_engine, "loss_function", lambda logits, targets: _LossFloor.apply(logits))],
        "clipping": [(native_engine, "clip_grad_norm", _clip_nothing)],
        "optimizer": [(native_engine, "optimizer_step", lambda optimizer, skip: None)],
    }


ALL = "all of the above"


@contextlib.contextmanager
def ablated(names: List[str]) -> Iterator[None]:
    """Swap in the stand-ins of ``names`` (``stand_ins()``'s keys) for the duration of the block."""
    table = stand_ins()
    swaps = [swap for name in names for swap in table[name]]
    saved = [(obj, attr, obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)) for obj, attr, _ in swaps]
    try:
        for obj, attr, new in swaps:
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)


def ablation_cases(step: Callable[[], None]) -> Dict[str, Callable[[], None]]:
    """``whole step`` plus one callable per ablation (and ``all of the above``), each one engine step."""
    names = list(stand_ins())

    def under(parts: List[str]) -> Callable[[], None]:
        def run() -> None:
            with ablated(parts):
                step()

        return run

    return {"whole step": step, **{name: under([name]) for name in names}, ALL: under(names)}


def main() -> None:
    from benchmarks.step import MODEL_GEMM_CASE, base_overrides, engine_step, model_gemm
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.runtime.hardware import pin_threads

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench_small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=9)
    add_host_malloc_flag(ap)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    malloc = host_memory.apply(args.host_malloc)
    base = base_overrides(args.model, args.batch)
    cfg = validate(compose(base), world_size=1)
    print(
        f"{args.model}: threads={threads}, host malloc {malloc}, micro batch {args.batch} x seq "
        f"{cfg.model.seq_len}, {args.repeats} repeats, eager; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    step = engine_step(base, args.batch)
    cases = [Case(name, fn) for name, fn in ablation_cases(step).items()]
    cases.append(model_gemm(cfg, args.batch))
    results = {
        r.name: r
        for r in run_suite(
            f"ablate-{args.model}", cases, repeats=args.repeats, warmup=2, baseline="whole step", progress=True
        )
    }
    whole = results["whole step"]
    print(
        f"\n| part taken out | cost, ms (paired median, min-max) | share of the whole step "
        f"({whole.median_s * 1e3:.0f} ms) |"
    )
    print("|---|---|---|")
    for name, r in results.items():
        if name in ("whole step", MODEL_GEMM_CASE):
            continue
        deltas = [w - t for w, t in zip(whole.times_s, r.times_s)]
        cost = statistics.median(deltas)
        print(
            f"| {name} | {cost * 1e3:.1f} ({min(deltas) * 1e3:.1f} to {max(deltas) * 1e3:.1f}) | "
            f"{cost / whole.median_s:.1%} |"
        )
    gemm, rest = results[MODEL_GEMM_CASE], results[ALL]
    left = [t / g for t, g in zip(rest.times_s, gemm.times_s)]
    print(
        f"\nfp32 GEMM probe at the step's shapes: {gemm.median_s * 1e3:.0f} ms "
        f"({gemm.median_s / whole.median_s:.1%} of the whole step); '{ALL}': {rest.median_s * 1e3:.0f} ms, "
        f"{statistics.median(left):.2f}x the probe (paired), the GEMMs' in-step time plus the embedding, residual "
        f"adds, autograd and the engine"
    )


if __name__ == "__main__":
    main()

"""Two parts of the training step on their own, each variant side by side (interleaved repeats, medians):

    python -m benchmarks.step_parts loss  [--model bench_small smoke gpt_125m] [--repeats 7] [--threads 0]
    python -m benchmarks.step_parts optim [--model bench_small] [--repeats 7] [--threads 0]

``loss``: forward + backward of the cross-entropy on the model's ``[tokens, vocab]`` logits (micro batch 8,
gpt_125m 1), fp32 and bf16 logits: ``F.cross_entropy(logits.float())`` (the formula before model/loss.py)
vs ``chunked_cross_entropy``. Also each one's peak of memory allocated during forward + backward (beyond
the logits themselves), from torch.profiler's allocation events in time order.

``optim``: one optimizer step over the model's parameters with random gradients: fused AdamW (the CPU
default), foreach AdamW, ``torch.compile`` of a foreach AdamW's ``step`` (compile time reported), and
gradient clipping: lmforge's ``clip_grad_norm`` (fp64 ``_foreach_norm`` + ``_foreach_mul_``), torch's
``clip_grad_norm_(foreach=True)`` and ``torch.compile`` of lmforge's.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import Case, run_suite
from lmforge.config.compose import compose
from lmforge.model.gpt import GPT
from lmforge.model.loss import chunked_cross_entropy
from lmforge.runtime.hardware import pin_threads


def old_loss(logits, targets):
    return F.cross_entropy(logits.float(), targets)


def loss_case(name, fn, logits, targets):
    x = logits.clone().requires_grad_(True)

    def run():
        fn(x, targets).backward()
        x.grad = None

    return Case(name, run, targets.numel(), "tokens")


def peak_bytes(fn, logits, targets) -> int:
    """Peak bytes allocated (above the start) during forward + backward at op granularity: every op's own net
    allocation (torch.profiler, ``self_cpu_memory_usage``) summed in the order the ops started."""
    x = logits.clone().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(x, targets).backward()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def loss_suite(models, repeats):
    for model in models:
        cfg = compose([f"model={model}"]).model
        tokens = (1 if model == "gpt_125m" else 8) * cfg.seq_len
        gen = torch.Generator().manual_seed(0)
        cases, peaks = [], {}
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(tokens, cfg.vocab_size, generator=gen) * 2).to(dtype)
            targets = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
            for label, fn in (("F.cross_entropy(.float())", old_loss), ("chunked", chunked_cross_entropy)):
                name = f"{label} {str(dtype)[6:]}"
                cases.append(loss_case(name, fn, logits, targets))
                peaks[name] = peak_bytes(fn, logits, targets)
        print(f"\n{model}: logits [{tokens}, {cfg.vocab_size}]; load average {os.getloadavg()[0]:.2f}", flush=True)
        for c in cases:
            c.extra["peak_MiB"] = peaks[c.name] / 2**20
        run_suite(f"loss-{model}", cases, repeats=repeats, baseline=cases[0].name)


def optim_suite(model, repeats):
    from lmforge.parallel.grad_clip import clip_grad_norm

    cfg = compose([f"model={model}"]).model
    torch.manual_seed(0)
    params = list(GPT(cfg).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    print(
        f"\n{model}: {sum(p.numel() for p in params) / 1e6:.1f}M parameters; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    def adamw(**kw):
        copies = [p.detach().clone().requires_grad_(True) for p in params]
        for c, p in zip(copies, params):
            c.grad = p.grad
        return copies, torch.optim.AdamW(copies, lr=1e-4, weight_decay=0.1, **kw)

    _, fused = adamw(fused=True)
    _, foreach = adamw(foreach=True)
    _, compiled_opt = adamw(foreach=True)
    compiled_step = torch.compile(compiled_opt.step)
    t0 = time.perf_counter()
    compiled_step()
    compile_s = time.perf_counter() - t0
    compiled_clip = torch.compile(clip_grad_norm)
    t0 = time.perf_counter()
    compiled_clip(params, 1e9)
    clip_compile_s = time.perf_counter() - t0
    cases = [
        Case("AdamW fused (CPU default)", fused.step, 1, "steps"),
        Case("AdamW foreach", foreach.step, 1, "steps"),
        Case("AdamW foreach, compiled step", compiled_step, 1, "steps", extra={"compile_s": compile_s}),
        Case("clip lmforge (fp64 foreach norm)", lambda: clip_grad_norm(params, 1e9), 1, "steps"),
        Case(
            "clip torch clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True), 1, "steps"
        ),
        Case(
            "clip lmforge, compiled",
            lambda: compiled_clip(params, 1e9),
            1,
            "steps",
            extra={"compile_s": clip_compile_s},
        ),
    ]
    run_suite(f"optim-{model}", cases, repeats=repeats, baseline=cases[0].name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["loss", "optim"])
    ap.add_argument("--model", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    print(f"threads={threads}, torch {torch.__version__}", flush=True)
    if args.part == "loss":
        loss_suite(args.model or ["bench_small", "smoke", "gpt_125m"], args.repeats)
    else:
        for model in args.model or ["bench_small"]:
            optim_suite(model, args.repeats)


if __name__ == "__main__":
    main()

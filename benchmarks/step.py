"""Training-step throughput against the machine's own matrix-multiply rate, measured side by side in one run
(the step-speed goal figures of docs/performance.md):

    python -m benchmarks.step [--model bench_small] [--batch 8] [--steps 1] [--repeats 5] [--threads 0]
                              [--no-compile] [--variants bf16 bf16-fp32-residual ac-full ...]
                              [--host-malloc retain|system]

Cases, interleaved round-robin after warm-up (``benchmarks/harness.py``), each timed over ``--steps`` steps:

- ``fp32 GEMM (model shapes)``: every matrix multiply one training step of this model does through its
  Linear layers and output head (forward, input-gradient and weight-gradient GEMM of each, at its real
  shapes, ``tokens = batch * seq_len`` rows), on random tensors. Its FLOPs are ``6 * N_matmul * tokens``,
  the matmul part of ``lmforge.model.flops``; its rate is *the same-run GEMM rate* every figure is put against.
- ``bare loop``: a plain PyTorch loop over the same ``GPT`` (forward, ``cross_entropy_loss``, backward,
  ``clip_grad_norm_``, fused AdamW, ``zero_grad``), eager and with the engine's compiled blocks.
- ``engine``: ``NativeEngine.train_step`` of the validated config, eager and with ``parallelism.compile``.

Model FLOPs come from the project's one FLOPs function (``lmforge.model.flops.flops_per_token``). Every case
prints as soon as it is built and warmed, and every repeat round as it finishes (flushed): a slow machine
shows progress. The default run (bench_small, 5 repeats, eager + compiled) takes about 1.5 minutes on an idle
2-core machine with ~1.7 s steps; gpt_125m at micro batch 1, eager, 3 repeats about 2.6 minutes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

import torch

from benchmarks.harness import Case, add_host_malloc_flag, run_suite
from lmforge.config.compose import compose
from lmforge.config.tokenizer_files import EMBEDDED_VOCAB, EOD_TOKEN
from lmforge.config.validate import validate
from lmforge.model.flops import flops_per_token, matmul_params
from lmforge.model.gpt import GPT, cross_entropy_loss
from lmforge.runtime import host_memory
from lmforge.runtime.hardware import pin_threads


def small_vocab_tokenizer(vocab: int) -> str:
    """A real tokenizer file with exactly ``vocab`` ids, for presets smaller than the embedded tokenizer
    (``model=bench_small`` has 256): the step benchmark feeds random ids, but ``validate()`` checks the vocabulary."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path = Path(tempfile.gettempdir()) / f"lmforge-bench-wordlevel-{vocab}.json"
    if not path.exists():
        words = {f"w{i}": i for i in range(vocab - 2)}
        words["<unk>"] = vocab - 2
        words[EOD_TOKEN] = vocab - 1
        tok = Tokenizer(WordLevel(words, unk_token="<unk>"))
        tok.add_special_tokens([EOD_TOKEN])
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tok.save(str(tmp))
        tmp.replace(path)  # atomic: concurrent benchmark runs never read a half-written file
    return str(path)


def base_overrides(model: str, batch: int, seq_len: int = 0) -> list[str]:
    base = [f"model={model}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}"]
    if seq_len:
        base.append(f"model.seq_len={seq_len}")
    vocab = int(compose(base).model.vocab_size)
    if vocab < EMBEDDED_VOCAB:
        base.append(f"data.tokenizer={small_vocab_tokenizer(vocab)}")
    return base


def bare_loop(cfg, batch: int, fused_optim: bool = True, compiled: bool = False):
    """A plain PyTorch training loop over the same model (fused AdamW, as the CPU default, unless told not)."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    model.init_weights(0)
    if compiled:
        from lmforge.parallel.compile import apply_compile

        apply_compile(model)  # the engine's own per-block compile: the same graphs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused_optim else {"foreach": True}))
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len))

    def step():
        loss = cross_entropy_loss(model(x), x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


GEMM_N = 2048
GEMM_CASE = "fp32 GEMM 2048^3 x8 (peak, same run)"
MODEL_GEMM_CASE = "fp32 GEMM (model shapes)"


def gemm(dtype=torch.float32, n: int = GEMM_N, calls: int = 8):
    """A square peak probe as a case of its own: interleaved with the steps, it sees the same machine state."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)

    def run():
        for _ in range(calls):
            torch.mm(a, b)

    return Case(GEMM_CASE, run, 2.0 * n**3 * calls, "flop")


def linear_shapes(cfg) -> List[Tuple[int, int]]:
    """(in_features, out_features) of every matrix multiply by a weight in one forward: the blocks' Linears
    and the output head (tied or not), from a model built on the meta device."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes.append((cfg.model.d_model, cfg.model.vocab_size))
    return shapes


def model_gemm(cfg, batch: int, steps: int = 1) -> Case:
    """The step's own GEMMs: for each weight ``[out, in]`` and ``tokens`` rows, Y = X W^T (forward),
    dX = dY W (input gradient) and dW = dY^T X (weight gradient), at fp32, ``steps`` times."""
    tokens = batch * cfg.model.seq_len
    gen = torch.Generator().manual_seed(0)
    shapes, mats = linear_shapes(cfg), []
    for k, n in sorted(set(shapes)):
        count = shapes.count((k, n))
        mats.append(
            (
                count,
                torch.randn(tokens, k, generator=gen),
                torch.randn(n, k, generator=gen),
                torch.randn(tokens, n, generator=gen),
            )
        )
    flops = sum(6.0 * tokens * k * n for k, n in shapes) * steps
    assert flops == 6.0 * matmul_params(cfg.model) * tokens * steps, "the probe must do the model's matmul FLOPs"

    def run():
        for _ in range(steps):
            for count, x, w, dy in mats:
                for _ in range(count):
                    torch.mm(x, w.t())
                    torch.mm(dy, w)
                    torch.mm(dy.t(), x)

    return Case(MODEL_GEMM_CASE, run, flops, "flop")


def engine_step(overrides, batch: int):
    from lmforge.comm.process_group import init_process_group
    from lmforge.parallel.native_engine import NativeEngine

    cfg = validate(compose(overrides), world_size=1)
    device = torch.device("cpu")
    init_process_group(cfg.comm, device)
    engine = NativeEngine(cfg, device)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len))

    class MB:
        tokens = x
        targets = x
        positions = None  # no document masking (lmforge.data.loader.MicroBatch)

    return lambda: engine.train_step([MB], 1e-4)


def repeated(fn, steps: int):
    def run():
        for _ in range(steps):
            fn()

    return run


VARIANTS = {  # opt-in engine variants (--variants), each one more case in the same interleaved suite
    "bf16": ["train.precision=bf16-mixed"],
    "bf16-fp32-residual": ["train.precision=bf16-mixed", "train.fp32_residual=true"],
    "ac-full": ["parallelism.activation_checkpointing=full"],
    "ac-selective": ["parallelism.activation_checkpointing=selective"],
    "foreach-adamw": ["optim.fused=false"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench_small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1, help="training steps per timed call")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed calls per case (median)")
    ap.add_argument("--no-compile", action="store_true", help="eager cases only (compile takes ~20-40 s a case)")
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS), help="extra engine cases")
    add_host_malloc_flag(ap)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    malloc = host_memory.apply(args.host_malloc)
    base = base_overrides(args.model, args.batch, args.seq_len)
    cfg = validate(compose(base), world_size=1)
    tokens = args.batch * cfg.model.seq_len * args.steps
    fpt = flops_per_token(cfg.model)
    print(
        f"{args.model}: threads={threads}, host malloc {malloc}, micro batch {args.batch} x seq "
        f"{cfg.model.seq_len}, {args.steps} step(s) per call, {args.repeats} repeats; model FLOPs/token {fpt:,} "
        f"(lmforge.model.flops); load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )

    def case(name, fn, compiled=False):
        t0 = time.perf_counter()
        fn()  # builds lazily / compiles on the first call
        extra = {"compile_s": time.perf_counter() - t0} if compiled else {}
        return Case(name, repeated(fn, args.steps), tokens, "tokens", extra=extra)

    builders = [
        (MODEL_GEMM_CASE, None, False),
        ("bare loop eager", lambda: bare_loop(cfg, args.batch), False),
        ("engine eager", lambda: engine_step(base, args.batch), False),
    ]
    if not args.no_compile:
        builders += [
            ("bare loop compiled", lambda: bare_loop(cfg, args.batch, compiled=True), True),
            ("engine compiled", lambda: engine_step(base + ["parallelism.compile=true"], args.batch), True),
        ]
    builders += [
        (f"engine eager {v}", lambda v=v: engine_step(base + VARIANTS[v], args.batch), False) for v in args.variants
    ]
    cases = []
    for name, build, compiled in builders:
        t0 = time.perf_counter()
        cases.append(model_gemm(cfg, args.batch, args.steps) if build is None else case(name, build(), compiled))
        print(f"  built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    results = run_suite(
        f"step-{args.model}", cases, repeats=args.repeats, warmup=1, baseline="engine eager", progress=True
    )
    by = {r.name: r for r in results}
    live = by[MODEL_GEMM_CASE].rate
    print(f"\nsame-run fp32 GEMM rate (model shapes): {live / 1e12:.3f} TFLOP/s; load average {os.getloadavg()[0]:.2f}")
    gemm_times = by[MODEL_GEMM_CASE].times_s
    print(
        "  case                         rate        of the same-run GEMM: medians / paired (median over rounds of "
        "the round's own ratio, min-max)"
    )
    for r in results:
        if r.name != MODEL_GEMM_CASE:
            gemm = by[MODEL_GEMM_CASE]
            paired = paired_ratios(r.times_s, gemm_times, r.rate * r.median_s * fpt, gemm.rate * gemm.median_s)
            print(
                f"  {r.name:<28} {r.rate * fpt / 1e12:.3f} TFLOP/s = {r.rate * fpt / live:6.1%} / "
                f"{statistics.median(paired):6.1%} ({min(paired):.1%}-{max(paired):.1%})"
            )
    for mode in ("eager", "compiled"):
        if f"engine {mode}" in by:
            eng, bare = by[f"engine {mode}"], by[f"bare loop {mode}"]
            rounds = [e / b - 1 for e, b in zip(eng.times_s, bare.times_s)]
            print(
                f"engine overhead vs bare loop, {mode}: {eng.median_s / bare.median_s - 1:+.1%} of the medians, "
                f"{statistics.median(rounds):+.1%} paired (min {min(rounds):+.1%}, max {max(rounds):+.1%}; "
                f"engine step time / bare loop step time - 1)"
            )


def paired_ratios(times: List[float], gemm_times: List[float], flops: float, gemm_flops: float) -> List[float]:
    """Per interleaved round, the case's FLOP rate over that round's own GEMM rate: the machine's drift between
    rounds (this VM's GEMM rate moves by +-15% within minutes) cancels out of each pair."""
    return [(flops / t) / (gemm_flops / g) for t, g in zip(times, gemm_times)]


if __name__ == "__main__":
    main()

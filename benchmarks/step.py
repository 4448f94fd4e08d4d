"""Training-step throughput: the lmforge engine step vs a bare eager loop, fp32 vs bf16 autocast,
activation checkpointing on vs off, fused/foreach vs for-loop AdamW, compile on vs off (opt-in).

    python -m benchmarks.step [--model smoke|gpt_125m] [--repeats 7] [--compile]

MFU uses the one FLOPs formula and the CPU GEMM peak measured on this machine at this thread count.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import Case, run_suite
from lmforge.config.compose import compose
from lmforge.config.tokenizer_files import EMBEDDED_VOCAB, EOD_TOKEN
from lmforge.config.validate import validate
from lmforge.model.flops import flops_per_token
from lmforge.model.gpt import GPT, cross_entropy_loss
from lmforge.runtime.hardware import peak_tflops, pin_threads


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
        tok.save(str(path))
    return str(path)


def base_overrides(model: str, batch: int, seq_len: int = 0) -> list[str]:
    base = [f"model={model}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}"]
    if seq_len:
        base.append(f"model.seq_len={seq_len}")
    vocab = int(compose(base).model.vocab_size)
    if vocab < EMBEDDED_VOCAB:
        base.append(f"data.tokenizer={small_vocab_tokenizer(vocab)}")
    return base


def bare_loop(cfg, batch: int, fused_optim: bool):
    torch.manual_seed(0)
    model = GPT(cfg.model)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=fused_optim)
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


def gemm(dtype=torch.float32, n: int = GEMM_N, calls: int = 8):
    """The peak probe as a case of its own: interleaved with the steps, it sees the same machine state."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)

    def run():
        for _ in range(calls):
            torch.mm(a, b)

    return Case(GEMM_CASE, run, 2.0 * n**3 * calls, "flop")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smoke")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: all cores)")
    ap.add_argument("--seq-len", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="add compile on/off cases (first compile takes ~30 s)")
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    base = base_overrides(args.model, args.batch, args.seq_len)
    cfg = validate(compose(base), world_size=1)
    tokens = args.batch * cfg.model.seq_len
    fpt = flops_per_token(cfg.model)
    peak32 = peak_tflops(torch.device("cpu"), torch.float32)
    peak16 = peak_tflops(torch.device("cpu"), torch.bfloat16)

    def mfu_extra(peak):
        return {"peak_tflops": peak}

    # 1) Platform overhead: only the bare loop and the engine, many interleaved repeats.
    overhead = run_suite(f"overhead-{args.model}", [
        Case("bare eager loop fp32", bare_loop(cfg, args.batch, True), tokens, "tokens"),
        Case("lmforge engine fp32", engine_step(base, args.batch), tokens, "tokens"),
        gemm(),
    ], repeats=args.repeats * 3, baseline="bare eager loop fp32")
    # 2) Variants of the engine step, side by side.
    cases = [
        Case("lmforge engine fp32", engine_step(base, args.batch), tokens, "tokens", extra=mfu_extra(peak32)),
        Case("lmforge engine bf16-mixed", engine_step(base + ["train.precision=bf16-mixed"], args.batch), tokens,
             "tokens", extra=mfu_extra(peak16)),
        Case("lmforge engine fp32 AC full", engine_step(base + ["parallelism.activation_checkpointing=full"], args.batch),
             tokens, "tokens", extra=mfu_extra(peak32)),
        Case("lmforge engine fp32 AC selective",
             engine_step(base + ["parallelism.activation_checkpointing=selective"], args.batch), tokens, "tokens",
             extra=mfu_extra(peak32)),
        Case("lmforge engine fp32 fused AdamW", engine_step(base + ["optim.fused=true"], args.batch), tokens, "tokens",
             extra=mfu_extra(peak32)),
        Case("bare loop fp32 foreach AdamW", bare_loop(cfg, args.batch, True), tokens, "tokens", extra=mfu_extra(peak32)),
        Case("bare loop fp32 for-loop AdamW", bare_loop(cfg, args.batch, False), tokens, "tokens",
             extra=mfu_extra(peak32)),
    ]
    cases.append(gemm())
    if args.compile:
        t0 = time.perf_counter()
        compiled = engine_step(base + ["parallelism.compile=true"], args.batch)
        compiled()  # first call compiles
        compile_s = time.perf_counter() - t0
        cases.append(Case("lmforge engine fp32 compiled", compiled, tokens, "tokens",
                          extra={**mfu_extra(peak32), "compile_s": compile_s}))
    results = run_suite(f"step-{args.model}", cases, repeats=args.repeats, baseline="lmforge engine fp32")
    live32 = next(r.rate for r in results if r.name == GEMM_CASE) / 1e12
    print(f"\nthreads={threads} flops/token={fpt:,} cached GEMM peak: fp32 {peak32:.3f} TFLOP/s, "
          f"bf16 {peak16:.3f} TFLOP/s; fp32 GEMM interleaved with these steps: {live32:.3f} TFLOP/s")
    for r in results:
        if r.name == GEMM_CASE:
            continue
        peak = r.extra["peak_tflops"]
        live = f"  {r.rate * fpt / 1e12 / live32:6.1%} of the same-run fp32 GEMM" if peak == peak32 else ""
        print(f"  {r.name:<36} MFU {r.rate * fpt / 1e12 / peak:6.1%} of the cached peak{live}"
              f"  ({r.rate * fpt / 1e12:.3f} TFLOP/s)")
    bare, eng, probe = overhead
    print(f"overhead suite: bare loop {bare.rate * fpt / probe.rate:.1%}, engine {eng.rate * fpt / probe.rate:.1%} "
          f"of the fp32 GEMM interleaved with them ({probe.rate / 1e12:.3f} TFLOP/s)")
    print(f"\nplatform overhead (engine step time / bare loop step time - 1, fp32): "
          f"{eng.median_s / bare.median_s - 1:+.1%}")


if __name__ == "__main__":
    main()

"""Decoding speed and KV-cache size.

    python -m benchmarks.decode [--model smoke|tiny] [--seq-len 256] [--lengths 32,64,112] [--prompt 16] [--repeats 3]
                                [--threads N]

1. tokens/s of `lmforge.generation.generate`, KV-cached vs recomputing the whole prefix every step (``use_cache=
   False``), one prompt of ``--prompt`` tokens, greedy, at growing numbers of new tokens (random init: the speed does
   not depend on the weights). Without a cache step t costs a forward over t tokens, so the ratio grows with length.
2. KV-cache bytes for one sequence at the preset's full context in bf16, multi-head vs grouped-query (8 KV heads) vs
   multi-query attention at the gpt_1b and gpt_7b shapes, read from a cache allocated on the meta device and checked
   against the formula 2 * layers * tokens * kv_heads * head_dim * bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
import yaml

from benchmarks.harness import Case, run_suite
from lmforge.config.model import ModelConfig
from lmforge.generation import KVCache, generate, kv_cache_bytes
from lmforge.model.gpt import GPT
from lmforge.runtime.hardware import pin_threads

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def preset(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((CONF / f"{name}.yaml").read_text()))


def speed(model_name: str, seq_len: int, prompt_len: int, lengths: list[int], repeats: int) -> None:
    cfg = preset(model_name)
    cfg = dataclasses.replace(cfg, seq_len=seq_len or cfg.seq_len)
    if prompt_len + max(lengths) > cfg.seq_len:
        raise SystemExit(
            f"--prompt {prompt_len} + --lengths max {max(lengths)} exceeds {model_name}'s seq_len "
            f"{cfg.seq_len}. Fix: shorter lengths or a larger --seq-len"
        )
    model = GPT(cfg)
    model.init_weights(0)
    model.eval()
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    for n in lengths:
        cases = [
            Case(
                f"{model_name} +{n} tokens, {'KV cache' if cached else 'no cache'}",
                (lambda cached=cached, n=n: generate(model, [prompt], n, use_cache=cached)),
                n,
                "tokens",
            )
            for cached in (False, True)
        ]
        run_suite(f"decode-{model_name}-{n}", cases, repeats=repeats, warmup=1)


def cache_bytes() -> None:
    print("\n== KV-cache bytes, one sequence at the full context, bf16 ==")
    print(f"{'shape':<8} {'attention':<10} {'kv heads':>8} {'tokens':>7} {'bytes':>15} {'GiB':>7} {'vs MHA':>7}")
    for name in ("gpt_1b", "gpt_7b"):
        cfg = preset(name)
        mha = None
        for kind, kv in (("MHA", cfg.n_heads), ("GQA", 8), ("MQA", 1)):
            c = dataclasses.replace(cfg, n_kv_heads=kv)
            cache = KVCache(c, 1, c.seq_len, torch.bfloat16, device="meta")
            n = cache.nbytes()
            assert n == kv_cache_bytes(c, 1, c.seq_len, torch.bfloat16)
            mha = mha or n
            print(f"{name:<8} {kind:<10} {kv:>8} {c.seq_len:>7} {n:>15,} {n / 2**30:>7.3f} {n / mha:>7.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smoke")
    ap.add_argument("--seq-len", type=int, default=0, help="the model's context (default: the preset's)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--lengths", default="32,64,112")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    threads = pin_threads(args.threads)
    print(f"threads={threads}")
    with torch.no_grad():
        speed(args.model, args.seq_len, args.prompt, [int(x) for x in args.lengths.split(",")], args.repeats)
    cache_bytes()


if __name__ == "__main__":
    main()

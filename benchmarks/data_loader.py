"""Data-path throughput: loader tokens/s next to what a training step consumes, and prepare MB/s.

    python -m benchmarks.data_loader [--configs smoke gpt_125m] [--steps 6] [--prepare-mb 2]
    python -m benchmarks.data_loader --suites prefetch [--workers 0 1 2] [--compute-ms 50] [--loop-steps 20]

For each experiment config the loader (BatchStream over the embedded 3-source megatron-core mixture at
the config's seq_len / micro / global batch) is timed building whole optimizer steps, and the model of
the same config is timed doing forward+backward on micro batches of real tokens on this machine's device.
Headroom = loader tokens/s / training tokens/s (goal >= 20x: the loader must never be the bottleneck).
On CPU the training side uses a smaller micro batch (``--train-micro``) so a gpt_125m step stays
affordable; tokens/s per micro batch is what is compared. Prepare throughput is measured on real text
(Austen) with 1 and 2 tokenizer processes. Medians of the repeats; the JSON goes to
benchmarks/results/scratch/data_loader.json.

Prefetch (``data.num_workers``): a loop alternates ``step_batches()`` with a simulated training step of fixed
duration (a matmul loop on the device, synchronised at its end as a logged loss would be) and times what the
loop waits for in ``step_batches()`` (including the host-to-device copy on CUDA) and the whole loop step (wait +
simulated step, which also shows any GIL contention the worker threads cause), for each worker count side by
side on the same mixture. The first step of each loop (built before any prefetch could start) is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from benchmarks.paths import scratch_path


def median_time(
    fn: Callable[[], None], repeats: int, warmup: int = 1, sync: Callable[[], None] = lambda: None
) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ensure_world() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{tempfile.mktemp(prefix='lmforge-bench-')}", rank=0, world_size=1
        )


def loader_and_train(exp: str, steps: int, train_micro: int, repeats: int, cache: Path, device: torch.device) -> Dict:
    from lmforge.config.batch import batch_plan
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.loader import BatchStream
    from lmforge.data.mixture import build_mixture
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.model.gpt import GPT, cross_entropy_loss

    cfg = validate(compose([f"+exp={exp}", f"data.cache_dir={cache}"]), world_size=1)
    m, t = cfg.model, cfg.train
    plan = batch_plan(t.micro_batch_size, t.global_batch_size, 1, m.seq_len)
    ensure_world()
    tok = load_tokenizer(cfg.data.tokenizer, cache)
    n = plan.global_batch_size * (steps * (repeats + 1) + 1)
    mixture = build_mixture(
        cfg.data,
        tok,
        seq_len=m.seq_len,
        seed=t.seed,
        num_train_samples=n,
        num_valid_samples=plan.micro_batch_size,
        cache_dir=cache,
    )
    stream = BatchStream(mixture, plan, dp_rank=0, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    loader_s = median_time(lambda: [stream.step_batches() for _ in range(steps)], repeats, sync=sync)
    loader_tps = steps * plan.tokens_per_step / loader_s

    micro = plan.micro_batch_size if device.type == "cuda" else min(train_micro, plan.micro_batch_size)
    torch.manual_seed(0)
    model = GPT(m).to(device)
    x = torch.stack([torch.as_tensor(mixture.train_sample(i)["tokens"]) for i in range(micro)]).long().to(device)
    y = torch.stack([torch.as_tensor(mixture.train_sample(i)["labels"]) for i in range(micro)]).long().to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def fwd_bwd() -> None:
        with amp:
            loss = cross_entropy_loss(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)

    train_s = median_time(fwd_bwd, max(2, repeats // 2), sync=sync)
    train_tps = micro * m.seq_len / train_s
    return {
        "config": exp,
        "seq_len": m.seq_len,
        "global_batch": plan.global_batch_size,
        "tokens_per_step": plan.tokens_per_step,
        "loader_tokens_per_s": loader_tps,
        "loader_step_ms": 1000 * loader_s / steps,
        "train_micro_measured": micro,
        "train_tokens_per_s": train_tps,
        "train_step_s": plan.tokens_per_step / train_tps,
        "headroom": loader_tps / train_tps,
    }


def simulated_compute(ms: float, device: torch.device) -> Callable[[], None]:
    """A training step stand-in: matmuls on ``device`` until ``ms`` have passed, then a device sync."""
    a = torch.randn(256, 256, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        end = time.perf_counter() + ms / 1000
        x = a
        while time.perf_counter() < end:
            for _ in range(4):
                x = torch.tanh(x @ a)
            sync()

    return step


def prefetch_latency(
    exp: str, workers: List[int], loop_steps: int, compute_ms: float, cache: Path, device: torch.device
) -> List[Dict]:
    from lmforge.config.batch import batch_plan
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.loader import BatchStream
    from lmforge.data.mixture import build_mixture
    from lmforge.data.tokenizer import load_tokenizer

    cfg = validate(compose([f"+exp={exp}", f"data.cache_dir={cache}"]), world_size=1)
    m, t = cfg.model, cfg.train
    plan = batch_plan(t.micro_batch_size, t.global_batch_size, 1, m.seq_len)
    ensure_world()
    tok = load_tokenizer(cfg.data.tokenizer, cache)
    n = plan.global_batch_size * (loop_steps + 4)
    mixture = build_mixture(
        cfg.data,
        tok,
        seq_len=m.seq_len,
        seed=t.seed,
        num_train_samples=n,
        num_valid_samples=plan.micro_batch_size,
        cache_dir=cache,
    )
    compute = simulated_compute(compute_ms, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    compute()  # warm the matmul path once
    rows = []
    for w in workers:
        stream = BatchStream(mixture, plan, dp_rank=0, device=device, num_workers=w)
        waits, steps = [], []
        try:
            for step in range(loop_steps):
                t0 = time.perf_counter()
                stream.step_batches()
                sync()
                t1 = time.perf_counter()
                compute()
                if step:
                    waits.append(t1 - t0)
                    steps.append(time.perf_counter() - t0)
        finally:
            stream.close()
        rows.append(
            {
                "config": exp,
                "workers": w,
                "samples_per_step": plan.global_batch_size,
                "micro_batches": plan.grad_accum,
                "compute_ms": compute_ms,
                "wait_ms_median": 1000 * statistics.median(waits),
                "wait_ms_max": 1000 * max(waits),
                "step_ms_median": 1000 * statistics.median(steps),
            }
        )
    for r in rows:
        r["wait_ratio_vs_first"] = r["wait_ms_median"] / rows[0]["wait_ms_median"]
        r["step_ratio_vs_first"] = r["step_ms_median"] / rows[0]["step_ms_median"]
    return rows


def prepare_rate(megabytes: float, cache: Path, workers: List[int]) -> List[Dict]:
    from lmforge.data.embedded import iter_documents
    from lmforge.data.prepare import prepare
    from lmforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded", cache)
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-prep-bench-"))
    budget, docs = int(megabytes * 1e6), []
    for doc in iter_documents("books"):
        docs.append(doc)
        budget -= len(doc.encode())
        if budget <= 0:
            break
    (tmp / "text").mkdir()
    for i, doc in enumerate(docs):
        (tmp / "text" / f"{i:04d}.txt").write_text(doc, encoding="utf-8")
    size = sum(p.stat().st_size for p in (tmp / "text").iterdir())
    out = []
    for w in workers:
        t0 = time.perf_counter()
        meta = prepare([str(tmp / "text")], tmp / f"w{w}", tok, workers=w)
        seconds = time.perf_counter() - t0
        out.append(
            {
                "workers": w,
                "mb": size / 1e6,
                "seconds": seconds,
                "mb_per_s": size / 1e6 / seconds,
                "tokens": meta["tokens"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--suites", nargs="+", default=["loader", "prepare", "prefetch"], choices=["loader", "prepare", "prefetch"]
    )
    ap.add_argument("--configs", nargs="+", default=["smoke", "gpt_125m"])
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per loader timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-micro", type=int, default=2, help="micro batch for the training side on CPU")
    ap.add_argument("--prepare-mb", type=float, default=2.0)
    ap.add_argument("--workers", nargs="+", type=int, default=[0, 1, 2], help="data.num_workers to compare")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="simulated training step duration")
    ap.add_argument("--loop-steps", type=int, default=20, help="steps per prefetch timing loop")
    ap.add_argument("--cache", default=os.environ.get("LMFORGE_DATA_CACHE", ".cache/lmforge-data"))
    args = ap.parse_args()
    cache = Path(args.cache).absolute()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = (
        [loader_and_train(c, args.steps, args.train_micro, args.repeats, cache, device) for c in args.configs]
        if "loader" in args.suites
        else []
    )
    prep = prepare_rate(args.prepare_mb, cache, [1, 2]) if args.prepare_mb > 0 and "prepare" in args.suites else []
    prefetch = (
        [
            r
            for c in args.configs
            for r in prefetch_latency(c, args.workers, args.loop_steps, args.compute_ms, cache, device)
        ]
        if "prefetch" in args.suites
        else []
    )

    if rows:
        print(f"\nloader vs training consumption ({device}, {torch.get_num_threads()} threads)")
        print(f"{'config':<10} {'seq':>5} {'tok/step':>9} {'loader tok/s':>13} {'train tok/s':>12} {'headroom':>9}")
        for r in rows:
            print(
                f"{r['config']:<10} {r['seq_len']:>5} {r['tokens_per_step']:>9} {r['loader_tokens_per_s']:>13,.0f} "
                f"{r['train_tokens_per_s']:>12,.0f} {r['headroom']:>8.1f}x"
            )
    if prep:
        print("\nprepare (real text, embedded BPE)")
        print(f"{'workers':>7} {'MB':>6} {'seconds':>8} {'MB/s':>7}")
        for p in prep:
            print(f"{p['workers']:>7} {p['mb']:>6.2f} {p['seconds']:>8.2f} {p['mb_per_s']:>7.3f}")
        print(f"prepare speedup 2 workers / 1 worker: {prep[1]['mb_per_s'] / prep[0]['mb_per_s']:.2f}x")
    if prefetch:
        print(
            f"\nstep_batches() wait seen by the loop, next to a {args.compute_ms:.0f} ms simulated step ({device}, "
            f"median of {args.loop_steps - 1} steps)"
        )
        first = f"vs {args.workers[0]}"
        print(
            f"{'config':<10} {'samples/step':>12} {'workers':>7} {'wait ms':>9} {'max ms':>8} {first:>7} "
            f"{'loop step ms':>12} {first:>7}"
        )
        for r in prefetch:
            print(
                f"{r['config']:<10} {r['samples_per_step']:>12} {r['workers']:>7} {r['wait_ms_median']:>9.3f} "
                f"{r['wait_ms_max']:>8.3f} {r['wait_ratio_vs_first']:>6.3f}x {r['step_ms_median']:>12.2f} "
                f"{r['step_ratio_vs_first']:>6.3f}x"
            )
    out = scratch_path("data_loader.json")
    saved = json.loads(out.read_text()) if out.exists() else {}  # keep the suites not run this time
    saved.update(
        {"device": str(device), **{k: v for k, v in (("loader", rows), ("prepare", prep), ("prefetch", prefetch)) if v}}
    )
    out.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()

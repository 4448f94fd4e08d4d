"""Learning-rate transfer across width: µP (model.parametrization=mup) against the standard parametrization.

    python -m benchmarks.mup_transfer [--widths 64 256] [--lr-exponents -11 ... -4] [--seeds 0 1] [--steps 200]
                                      [--jobs N] [--out FILE] [--plot FILE]

For each parametrization, width, learning rate (a 2x grid, lr = 2^e) and seed: lmforge's GPT (2 layers, 4 heads,
SwiGLU, untied, vocab 512, seq_len 64, mup_base_width = the first width) trained with lmforge's AdamW groups
(optim/adamw.py) and cosine schedule (optim/schedule.py, 10% warmup, floor 0.1, weight decay 0.1, grad clip 1)
on the embedded books/code/reference mixture with the 512-token BPE, batch 8 x 64 tokens; the score is the mean
validation loss at the end over 48 held-out samples (16 of each source). Every run sees the same batches (the data does not depend on
the seed; the seed sets the init). A width's optimum is the grid point of lowest seed-mean loss. Passes when the
µP optima of the two widths are at most one grid point apart; SP's shift is reported.

Writes the JSON (default benchmarks/results/scratch/mup-transfer.json) and the plot (--plot, optional).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import time
from pathlib import Path
from typing import Dict, List

import torch

from benchmarks.data_loader import ensure_world
from benchmarks.paths import scratch_path

BATCH, SEQ_LEN, VOCAB, VALID_PER_SOURCE = 8, 64, 512, 16


def data(steps: int, cache: Path):
    """(train batches, valid batches), each a list of (inputs [B, T], labels [B, T]), from the embedded mixture."""
    from lmforge.config.compose import compose
    from lmforge.data.mixture import build_mixture
    from lmforge.data.tokenizer import build_embedded_tokenizer, load_tokenizer

    tok = load_tokenizer(str(build_embedded_tokenizer(cache, VOCAB)))
    cfg = compose([]).data
    mix = build_mixture(
        cfg,
        tok,
        seq_len=SEQ_LEN,
        seed=0,
        num_train_samples=steps * BATCH,
        num_valid_samples=VALID_PER_SOURCE,
        cache_dir=cache,
    )

    def stack(samples) -> tuple:
        x = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
        y = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
        return x, y

    train = [stack([mix.train_sample(s * BATCH + i) for i in range(BATCH)]) for s in range(steps)]
    held_out = [ds[i] for ds in mix.valid.values() for i in range(VALID_PER_SOURCE)]  # each source equally
    valid = [stack(held_out[i : i + BATCH]) for i in range(0, len(held_out), BATCH)]
    return train, valid


def train_one(par: str, width: int, base: int, lr: float, seed: int, train, valid) -> float:
    from lmforge.config.model import ModelConfig
    from lmforge.config.optim import OptimConfig
    from lmforge.model.gpt import GPT, cross_entropy_loss
    from lmforge.optim.adamw import build_optimizer, set_learning_rate
    from lmforge.optim.schedule import lr_multiplier

    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=width,
        n_layers=2,
        n_heads=4,
        seq_len=SEQ_LEN,
        ffn_multiple_of=16,
        tie_embeddings=False,
        parametrization=par,
        mup_base_width=base,
    )
    steps = len(train)
    optim = OptimConfig(lr=lr, weight_decay=0.1, warmup_steps=steps // 10, schedule="cosine", min_lr_ratio=0.1)
    model = GPT(cfg)
    model.init_weights(seed)
    opt = build_optimizer(model, optim, torch.device("cpu"), cfg)
    for step, (x, y) in enumerate(train):
        set_learning_rate(opt, lr * lr_multiplier(step, optim, steps))
        loss = cross_entropy_loss(model(x), y)
        if not torch.isfinite(loss):
            return float("inf")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        losses = [cross_entropy_loss(model(x), y).item() for x, y in valid]
    value = sum(losses) / len(losses)
    return value if math.isfinite(value) else float("inf")


_DATA: tuple = ()  # (base width, train batches, valid batches), set before the worker pool forks


def _task(task: tuple) -> float:
    torch.set_num_threads(1)
    par, width, e, seed = task
    base, train, valid = _DATA
    t0 = time.time()
    loss = train_one(par, width, base, 2.0**e, seed, train, valid)
    print(f"  {par} width {width} lr 2^{e} seed {seed}: {loss:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return loss


def optimum(curve: Dict[int, List[float]]) -> int:
    """The grid exponent of lowest seed-mean loss."""
    return min(curve, key=lambda e: sum(curve[e]) / len(curve[e]))


def run(
    widths: List[int],
    exponents: List[int],
    seeds: List[int],
    steps: int,
    cache: Path,
    jobs: int,
    parametrizations: List[str],
    base: int,
) -> Dict:
    torch.set_num_threads(1)
    ensure_world()  # the mixture's index build runs megatron-core's rank-0 logic
    train, valid = data(steps, cache)
    results: Dict = {"parametrizations": {}}
    start = time.time()
    tasks = [(par, w, e, s) for par in parametrizations for w in widths for e in exponents for s in seeds]
    global _DATA
    _DATA = (base, train, valid)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:  # fork: the workers share the batches
        losses = dict(zip(tasks, pool.imap(_task, tasks)))
    for par in parametrizations:
        per_width = {}
        for width in widths:
            curve = {e: [losses[(par, width, e, s)] for s in seeds] for e in exponents}
            for e in exponents:
                print(f"{par:>4} width {width:>4} lr 2^{e:<3} val loss {sum(curve[e]) / len(seeds):.4f}")
            per_width[str(width)] = {
                "losses": {str(e): v for e, v in curve.items()},
                "optimum_exponent": optimum(curve),
            }
        opt = [per_width[str(w)]["optimum_exponent"] for w in widths]
        results["parametrizations"][par] = {"widths": per_width, "optimum_shift_grid_points": opt[-1] - opt[0]}
    mup_shift = results["parametrizations"].get("mup", {}).get("optimum_shift_grid_points", 0)
    results.update(
        {
            "benchmark": "mup_transfer",
            "widths": widths,
            "base_width": base,
            "lr_grid": {"base": 2, "exponents": exponents},
            "seeds": seeds,
            "steps": steps,
            "tokens_per_run": steps * BATCH * SEQ_LEN,
            "batch": BATCH,
            "seq_len": SEQ_LEN,
            "vocab": VOCAB,
            "model": "2 layers, 4 heads, SwiGLU, untied; AdamW wd 0.1, cosine, 10% warmup, clip 1",
            "data": "embedded books/code/reference mixture, 512-token BPE; val loss over 48 held-out samples, 16 per source",
            "passed": abs(mup_shift) <= 1,
            "seconds": round(time.time() - start, 1),
            "host": platform.processor() or platform.machine(),
            "threads_per_run": 1,
            "jobs": jobs,
        }
    )
    return results


def plot(results: Dict, path: Path) -> None:
    import matplotlib  # deferred: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: only the plot needs it

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, par in zip(axes, ("sp", "mup")):
        for width, entry in results["parametrizations"][par]["widths"].items():
            es = sorted(int(e) for e in entry["losses"])
            means = [sum(entry["losses"][str(e)]) / len(entry["losses"][str(e)]) for e in es]
            ax.plot([2.0**e for e in es], means, marker="o", label=f"width {width}")
            best = entry["optimum_exponent"]
            ax.axvline(2.0**best, color=ax.lines[-1].get_color(), ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("learning rate (optim.lr)")
        ax.set_title({"sp": "standard parametrization", "mup": f"µP (base width {results['base_width']})"}[par])
        ax.legend()
    axes[0].set_ylabel(f"validation loss after {results['tokens_per_run']:,} tokens")
    lows = [min(sum(v) / len(v) for v in e["losses"].values()) for p in results["parametrizations"].values()
            for e in p["widths"].values()]  # fmt: skip
    axes[0].set_ylim(min(lows) - 0.1, min(lows) + 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.mup_transfer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--base-width", type=int, default=None, help="model.mup_base_width (default: the first width)")
    ap.add_argument("--lr-exponents", type=int, nargs="+", default=list(range(-11, -3)))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=scratch_path("mup-transfer.json"))
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    ap.add_argument("--parametrizations", nargs="+", default=["mup", "sp"], choices=["mup", "sp"])
    ap.add_argument("--cache", type=Path, default=scratch_path("mup-transfer-data"), help="tokenizer and index cache")
    args = ap.parse_args(argv)
    base = args.base_width or args.widths[0]
    results = run(
        args.widths, args.lr_exponents, args.seeds, args.steps, args.cache, args.jobs, args.parametrizations, base
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot is not None:
        plot(results, args.plot)
    for par, entry in results["parametrizations"].items():
        opts = {w: f"2^{v['optimum_exponent']}" for w, v in entry["widths"].items()}
        print(f"{par}: optima {opts}, shift {entry['optimum_shift_grid_points']} grid points")
    print(f"passed: {results['passed']} ({results['seconds']} s) -> {args.out}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

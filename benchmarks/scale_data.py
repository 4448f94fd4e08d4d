"""How data costs grow with the corpus: ``lmforge data prepare``, the sample-index build and the loader's start-up
in CPU-seconds at growing corpus sizes (the data half of benchmarks/scale_growth.py).

    python -m benchmarks.scale_data [--mb 10 100 1000] [--seq-len 512] [--budget-s 300]

The corpus of each size is the embedded corpora (Austen novels, Python stdlib source) repeated, each copy's
documents prefixed with a marker line (``copy K``) so no two documents are equal, written as JSONL files of at
most 64 MB. Per size, each phase runs in its own process (CPU-seconds of that process and its children, the load
average recorded next to it):

- prepare: ``lmforge data prepare FILES --out DIR --shard-size 1 --workers 1`` (one shard per input file);
- index: ``build_mixture`` over the prepared directory, one epoch of ``--seq-len`` samples, index cache empty
  (megatron-core's document, sample and shuffle indices, built and saved);
- loader start-up: the same ``build_mixture`` with the cache filled, then the first step's batches
  (``BatchStream.step_batches``).

Sizes run in increasing order; a size whose prepare is projected (from the previous size's rate) to take more
than ``--budget-s`` of wall time is left out and named in the output. JSON: benchmarks/results/scratch/scale_data.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.paths import scratch_path
from lmforge.runtime.hardware import cpu_model

FILE_MB = 64.0


def children_cpu_s() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def write_corpus(mb: float, root: Path) -> Dict:
    """JSONL files of ``mb`` MB of text: the embedded corpora, copy after copy, each document marked with its copy."""
    from lmforge.data.embedded import iter_documents

    base = [d for name in ("books", "code") for d in iter_documents(name)]
    root.mkdir(parents=True)
    size, docs, copy, files, out, file_size = 0, 0, 0, 0, None, 0.0
    while size < mb * 1e6:
        for d in base:
            if out is None or file_size >= FILE_MB * 1e6:
                if out is not None:
                    out.close()
                out, file_size, files = open(root / f"part-{files:04d}.jsonl", "w"), 0.0, files + 1
            text = f"copy {copy}\n{d}"
            out.write(json.dumps({"text": text}) + "\n")
            n = len(text.encode())
            size, file_size, docs = size + n, file_size + n, docs + 1
            if size >= mb * 1e6:
                break
        copy += 1
    out.close()
    return {"text_bytes": size, "documents": docs, "files": files, "copies": copy}


def timed(cmd: List[str], env: Dict[str, str]) -> Dict:
    """Run ``cmd`` to completion; its wall seconds and CPU-seconds (it and its children), and the load average."""
    load0, cpu0, t0 = os.getloadavg()[0], children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {
        "wall_s": round(time.perf_counter() - t0, 2),
        "cpu_s": round(children_cpu_s() - cpu0, 2),
        "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "stdout": proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else [],
    }


def mixture_phase(shards: str, cache: str, seq_len: int, first_batch: bool) -> None:
    """In its own process: build the mixture over ``shards`` (one epoch of samples), optionally the first batch;
    prints the sample count and the index files' bytes."""
    import torch
    import torch.distributed as dist

    from lmforge.config.batch import batch_plan
    from lmforge.config.data import DataConfig, DataSourceConfig
    from lmforge.data.loader import BatchStream
    from lmforge.data.mixture import build_mixture
    from lmforge.data.tokenizer import load_tokenizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cache_dir = Path(cache)
    tok = load_tokenizer("embedded", cache_dir)
    manifest = json.loads((Path(shards) / "manifest.json").read_text())
    tokens = int(manifest.get("tokens") or sum(s.get("tokens", 0) for s in manifest.get("shards", [])))
    samples = max(1, int(tokens * 0.98) // seq_len - 1)
    cfg = DataConfig(name="scale", sources={"corpus": DataSourceConfig(path=shards, weight=1.0)}, max_epochs=0)
    mixture = build_mixture(
        cfg, tok, seq_len=seq_len, seed=0, num_train_samples=samples, num_valid_samples=1, cache_dir=cache_dir
    )
    if first_batch:
        plan = batch_plan(8, 8, 1, seq_len)
        BatchStream(mixture, plan, dp_rank=0, device=torch.device("cpu")).step_batches()
    index_bytes = sum(p.stat().st_size for p in (cache_dir / "index").rglob("*") if p.is_file())
    print(json.dumps({"tokens": tokens, "samples": samples, "index_bytes": index_bytes}))


def measure_size(mb: float, seq_len: int, root: Path, env: Dict[str, str]) -> Dict:
    corpus = write_corpus(mb, root / "raw")
    out, cache = root / "prepared", root / "cache"
    row = {"corpus_mb": mb, "seq_len": seq_len, **corpus}
    row["prepare"] = timed(
        [sys.executable, "-m", "lmforge.cli", "data", "prepare", str(root / "raw"), "--out", str(out)]
        + ["--shard-size", "1", "--workers", "1", "--no-progress"],
        env,
    )
    phase = [sys.executable, "-m", "benchmarks.scale_data", "--phase", str(out), str(cache), str(seq_len)]
    row["index_build"] = timed(phase + ["index"], env)
    row["loader_start"] = timed(phase + ["loader"], env)
    row.update(json.loads(row["loader_start"].pop("stdout")[0]))
    row["index_build"].pop("stdout")
    row["prepare"].pop("stdout")
    row["prepared_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(root)
    return row


EXTRAPOLATE_MB = (1_000, 1_000_000)  # 1 GB and 1 TB of text
MODELS = {  # phase -> (the size it grows with, the model in words)
    "prepare": ("corpus_mb", "read + tokenize + write every byte once: O(bytes)"),
    "index_build": ("samples", "megatron-core's document, sample and shuffle indices: O(documents + samples)"),
    "loader_start": ("samples", "the cached indices memory-mapped, the first batch read: O(1)"),
}
CONSTANT = {"loader_start"}  # no term that grows: c = 0, the deviation says how far the points are from flat


def check_models(rows: List[Dict]) -> Dict[str, Dict]:
    """Per phase: CPU-s = q(smallest) + c * (x - x(smallest)), only c fitted (least squares); the largest relative
    distance of a point from it, and the model at 1 GB and 1 TB (samples scaled by the measured tokens per MB).
    A phase whose growth is below what the points resolve (modelled constant, or a fitted c below 0) gets c = 0 and
    an upper bound, ``c_upper``: the points' spread over the measured range, with the model at 1 GB and 1 TB under
    that bound."""
    if len(rows) < 2:
        return {}
    first, out = rows[0], {}
    tokens_per_mb = rows[-1]["tokens"] / rows[-1]["corpus_mb"]
    for phase, (x, words) in MODELS.items():
        y0, x0 = first[phase]["cpu_s"], first[x]
        pairs = [(r[x] - x0, r[phase]["cpu_s"] - y0) for r in rows[1:]]
        c = 0.0 if phase in CONSTANT else sum(a * b for a, b in pairs) / sum(a * a for a, _ in pairs)
        unresolved = c <= 0.0
        c = max(c, 0.0)
        size = (lambda mb: mb) if x == "corpus_mb" else (lambda mb: mb * tokens_per_mb / first["seq_len"])
        model = lambda v, c=c, y0=y0, x0=x0: y0 + c * (v - x0)  # noqa: E731
        out[phase] = {
            "model": words,
            "per": x,
            "c": c,
            "max_rel_deviation": round(max(abs(model(r[x]) - r[phase]["cpu_s"]) / r[phase]["cpu_s"] for r in rows), 4),
            "extrapolated_cpu_s": {f"{mb:g}MB": round(model(size(mb)), 1) for mb in EXTRAPOLATE_MB},
        }
        if unresolved:
            ys = [r[phase]["cpu_s"] for r in rows]
            c_upper = (max(ys) - min(ys)) / (max(r[x] for r in rows) - x0)
            out[phase]["c_upper"] = c_upper
            out[phase]["extrapolated_cpu_s_upper"] = {
                f"{mb:g}MB": round(y0 + c_upper * (size(mb) - x0), 1) for mb in EXTRAPOLATE_MB
            }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=300.0, help="leave out a size projected to prepare longer")
    ap.add_argument("--phase", nargs=4, metavar=("SHARDS", "CACHE", "SEQ_LEN", "WHICH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.phase:
        shards, cache, seq_len, which = args.phase
        mixture_phase(shards, cache, int(seq_len), first_batch=which == "loader")
        return 0
    cache = Path(os.environ.get("LMFORGE_DATA_CACHE", ".cache/lmforge-data"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "LMFORGE_DATA_CACHE": str(cache)}
    rows, left_out, rate = [], [], None
    for mb in sorted(args.mb):
        if rate is not None and mb / rate > args.budget_s:
            left_out.append({"corpus_mb": mb, "projected_prepare_s": round(mb / rate), "budget_s": args.budget_s})
            print(f"{mb:g} MB: left out, prepare projected at {mb / rate:.0f} s > --budget-s {args.budget_s:g}")
            continue
        with tempfile.TemporaryDirectory(prefix="lmforge-scale-data-") as tmp:
            row = measure_size(mb, args.seq_len, Path(tmp) / "w", env)
        rate = mb / row["prepare"]["wall_s"]
        rows.append(row)
        print(
            f"{mb:>7g} MB ({row['documents']:,} docs, {row['tokens']:,} tokens): prepare {row['prepare']['cpu_s']:.1f} "
            f"CPU-s, index build {row['index_build']['cpu_s']:.1f} CPU-s ({row['samples']:,} samples, "
            f"{row['index_bytes'] / 2**20:.2f} MiB), loader start-up {row['loader_start']['cpu_s']:.1f} CPU-s "
            f"(load {row['prepare']['load_average'][0]})",
            flush=True,
        )
    payload = {
        "suite": "scale_data",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform()},
        "args": {k: v for k, v in vars(args).items() if k != "phase"},
        "rows": rows,
        "left_out": left_out,
        "models": check_models(rows),
    }
    for phase, m in payload["models"].items():
        bound = ""
        if "c_upper" in m:
            up = m["extrapolated_cpu_s_upper"]
            bound = f" (growth below resolution: c <= {m['c_upper']:.3g}, at most {up['1000MB']} and {up['1e+06MB']})"
        print(
            f"{phase}: {m['model']}; c = {m['c']:.4g} CPU-s per {m['per']}, max deviation {m['max_rel_deviation']:.1%}, "
            f"at 1 GB {m['extrapolated_cpu_s']['1000MB']} CPU-s, at 1 TB {m['extrapolated_cpu_s']['1e+06MB']} CPU-s"
            + bound
        )
    scratch_path("scale_data.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`lmforge data prepare` MB/s per input format vs the raw tokenizer ``encode_batch`` rate, same text, same run.

    python -m benchmarks.data_prepare [--mb 8] [--workers 1 2] [--repeats 2] [--files 8]

Real text (Austen novels and Python stdlib source, the embedded corpora) is written as ``--files`` files in
each input format: .jsonl, .jsonl.gz, .jsonl.zst, .parquet and a ``datasets`` save_to_disk directory. For
each format and worker count W, two cases run interleaved (raw, prepare, raw, prepare, ...):

- raw: the same documents, already in memory, through ``encode_batch`` in W single-threaded processes
  (a spawn pool started inside the timed region, chunks of 1 MiB of text, as prepare does; W = 1: in-process);
- prepare: the sharded preparation (plan, read + decode the format, tokenize in W processes, write the
  .bin/.idx shards, sha256 of the inputs, the final manifest check), from files to a complete directory.

Rate = text MB (UTF-8 bytes of the documents) / seconds, the median of the repeats; ratio = prepare / raw
(of the medians); the spread is the range of each repeat's back-to-back raw / prepare ratio. The CPU ratio
(raw CPU seconds / prepare CPU seconds, this process's threads plus its reaped worker processes) measures the
extra work prepare does, which a loaded machine's scheduling does not move much; wall ratios above 1 come from
the reader thread's work overlapping the tokenizer's.
TOKENIZERS_PARALLELISM=false throughout, so W processes use W threads in both cases. JSON goes to
benchmarks/results/scratch/data_prepare.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from benchmarks.paths import scratch_path

FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow-dataset")


def corpus(mb: float) -> List[str]:
    from lmforge.data.embedded import iter_documents

    docs, size = [], 0
    while size < mb * 1e6:
        for name in ("books", "code"):
            for d in iter_documents(name):
                docs.append(d)
                size += len(d.encode())
                if size >= mb * 1e6:
                    return docs
    return docs


def write_format(fmt: str, docs: List[str], files: int, root: Path) -> Path:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    datasets.disable_progress_bars()
    out = root / fmt
    out.mkdir(parents=True)
    for i in range(files):
        part = docs[i::files]
        lines = "".join(json.dumps({"text": t}) + "\n" for t in part)
        if fmt == "jsonl":
            (out / f"p{i:03d}.jsonl").write_text(lines)
        elif fmt == "jsonl.gz":
            with gzip.open(out / f"p{i:03d}.jsonl.gz", "wt", encoding="utf-8") as fh:
                fh.write(lines)
        elif fmt == "jsonl.zst":
            (out / f"p{i:03d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines.encode()))
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": part}), out / f"p{i:03d}.parquet")
        else:
            datasets.Dataset.from_dict({"text": part}).save_to_disk(str(out / f"p{i:03d}"))
    return out


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its reaped children (pool workers)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def raw_rate(docs: List[str], tok, workers: int) -> tuple:
    from lmforge.data.tokenize_pool import CHUNK_CHARS, _chunks, _encode_chunk, _init_worker

    t0, c0 = time.perf_counter(), cpu_seconds()
    if workers <= 1:
        for chunk in _chunks(iter(docs), CHUNK_CHARS):
            tok.encode_batch(chunk)
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers, _init_worker, (tok.source,)) as pool:
            for _ in pool.imap(_encode_chunk, _chunks(iter(docs), CHUNK_CHARS)):
                pass
    return time.perf_counter() - t0, cpu_seconds() - c0


def prepare_time(src: Path, tok, workers: int, files_per_shard: int, scratch: Path) -> tuple:
    from lmforge.data import sharded_prepare

    out = scratch / "out"
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), cpu_seconds()
    plan = sharded_prepare.write_or_check_plan(
        out, sharded_prepare.make_plan([str(src)], tok, files_per_shard, "text", "stop")
    )
    sharded_prepare.build_shards(out, plan, tok, workers)
    manifest = sharded_prepare.finalize(out)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    assert manifest["complete"] and manifest["empty_rows"] == 0
    return seconds, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=8.0, help="MB of text per format")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--files-per-shard", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    args = ap.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from lmforge.data.tokenizer import load_tokenizer

    cache = Path(os.environ.get("LMFORGE_DATA_CACHE", ".cache/lmforge-data"))
    tok = load_tokenizer("embedded", cache)
    docs = corpus(args.mb)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: F401  one-time import, untimed

    mb = sum(len(d.encode()) for d in docs) / 1e6
    rows: List[Dict] = []
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-prepare-") as tmp:
        root = Path(tmp)
        for fmt in args.formats:
            src = write_format(fmt, docs, args.files, root / "in")
            for w in args.workers:
                raw, prep, raw_cpu, prep_cpu = [], [], [], []
                for _ in range(args.repeats):  # interleaved: drift of a shared machine hits both alike
                    for times, cpus, (wall, cpu) in (
                        (raw, raw_cpu, raw_rate(docs, tok, w)),
                        (prep, prep_cpu, prepare_time(src, tok, w, args.files_per_shard, root)),
                    ):
                        times.append(wall)
                        cpus.append(cpu)
                r, p = statistics.median(raw), statistics.median(prep)
                pairs = sorted(a / b for a, b in zip(raw, prep))  # each repeat's raw / prepare, run back to back
                row = {
                    "format": fmt,
                    "workers": w,
                    "text_mb": round(mb, 2),
                    "raw_mb_per_s": round(mb / r, 3),
                    "prepare_mb_per_s": round(mb / p, 3),
                    "prepare_mb_per_s_per_worker": round(mb / p / w, 3),
                    "ratio": round(r / p, 3),
                    "pair_ratio_median": round(statistics.median(pairs), 3),
                    "pair_ratio_min": round(pairs[0], 3),
                    "pair_ratio_max": round(pairs[-1], 3),
                    "raw_s": [round(x, 3) for x in raw],
                    "prepare_s": [round(x, 3) for x in prep],
                    # CPU seconds (all threads and worker processes): the work done, whatever the load
                    "cpu_ratio": round(statistics.median(raw_cpu) / statistics.median(prep_cpu), 3),
                    "raw_cpu_s": [round(x, 3) for x in raw_cpu],
                    "prepare_cpu_s": [round(x, 3) for x in prep_cpu],
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                }
                rows.append(row)
                print(
                    f"{fmt:14s} workers={w}  raw {row['raw_mb_per_s']:7.2f} MB/s  prepare "
                    f"{row['prepare_mb_per_s']:7.2f} MB/s ({row['prepare_mb_per_s_per_worker']:.2f}/worker)  "
                    f"ratio {row['ratio']:.2f} (pairs {pairs[0]:.2f}-{pairs[-1]:.2f}, median "
                    f"{row['pair_ratio_median']:.2f}; cpu ratio {row['cpu_ratio']:.2f}; "
                    f"load {row['load_average'][0]})",
                    flush=True,
                )
    scratch_path("data_prepare.json").write_text(
        json.dumps(
            {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "args": vars(args), "rows": rows},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

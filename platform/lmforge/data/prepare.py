"""Tokenize text into Megatron shards: ``lmforge data prepare`` / ``python -m lmforge.data.prepare``.

Inputs: text files (one document per file), directories of them (recursively, by suffix), JSONL files
(one document per line, from a ``text`` field; ``--json-key`` to change it), or ``embedded:NAME``.
Documents are tokenized in worker processes (``--workers``), reassembled in input order, given an
end-of-document token, and written with megatron-core's ``IndexedDatasetBuilder`` as PREFIX.bin/.idx
(uint16 when the vocabulary fits, else int32) plus PREFIX.meta.json recording the tokenizer identity.
The output does not depend on the number of workers.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Deque, Iterator, List, Optional, Sequence

import numpy as np

from lmforge.data.shards import ensure_shard, write_shard
from lmforge.data.tokenizer import Tokenizer, load_tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".go", ".c", ".h", ".json", ".html", ".tex", ""}
CHUNK_CHARS = 1 << 20  # text per worker task


def list_files(inputs: Sequence[str]) -> List[Path]:
    files: List[Path] = []
    for item in inputs:
        if item.startswith("embedded:"):
            continue
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"input '{item}' does not exist. Fix: give existing files, directories or "
                                    "embedded:books|code|reference")
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES
                                                                            or p.suffix == ".jsonl"))
        else:
            files.append(path)
    return files


def iter_inputs(inputs: Sequence[str], json_key: str = "text") -> Iterator[str]:
    """Every document of the inputs, in a fixed order (argument order, then sorted paths)."""
    from lmforge.data.embedded import iter_documents

    for item in inputs:
        if item.startswith("embedded:"):
            yield from iter_documents(item.split(":", 1)[1])
            continue
        for f in list_files([item]):
            if f.suffix == ".jsonl":
                with open(f, encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        try:
                            text = json.loads(line)[json_key]
                        except (ValueError, KeyError, TypeError):
                            raise ValueError(f"{f}:{n}: not a JSON object with a '{json_key}' field. Fix: one JSON "
                                             f"object per line, or --json-key NAME") from None
                        if not isinstance(text, str):
                            raise ValueError(f"{f}:{n}: field '{json_key}' is {type(text).__name__}, not a string")
                        if text.strip():
                            yield text
            else:
                text = f.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    yield text


def _chunks(docs: Iterator[str], chunk_chars: int) -> Iterator[List[str]]:
    buf: List[str] = []
    size = 0
    for doc in docs:
        buf.append(doc)
        size += len(doc)
        if size >= chunk_chars:
            yield buf
            buf, size = [], 0
    if buf:
        yield buf


# ---- worker processes ------------------------------------------------------------------------------
_WORKER_TOKENIZER: Optional[Tokenizer] = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process = one core; the pool gives the parallelism
    _WORKER_TOKENIZER = load_tokenizer(spec)


def _encode_chunk(texts: List[str]) -> List[np.ndarray]:
    assert _WORKER_TOKENIZER is not None
    dtype = np.uint16 if _WORKER_TOKENIZER.vocab_size <= 65536 else np.int32
    return [np.asarray(ids, dtype=dtype) for ids in _WORKER_TOKENIZER.encode_batch(texts)]


def tokenize_docs(docs: Iterator[str], tokenizer: Tokenizer, workers: int = 1, progress: bool = False,
                  total_chars: Optional[int] = None, stats: Optional[dict] = None) -> Iterator[np.ndarray]:
    """Token ids of each document, in input order; ``workers`` > 1 tokenizes in that many processes."""
    from tqdm import tqdm

    bar = tqdm(total=total_chars, unit="B", unit_scale=True, desc="tokenizing", disable=not progress,
               file=sys.stderr, mininterval=0.5)
    stats = stats if stats is not None else {}
    stats.setdefault("chars", 0)
    try:
        if workers <= 1:
            for chunk in _chunks(docs, CHUNK_CHARS):
                for ids in tokenizer.encode_batch(chunk):
                    yield np.asarray(ids)
                n = sum(len(d) for d in chunk)
                stats["chars"] += n
                bar.update(n)
            return
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # no fork: the parent may hold tokenizer / torch threads
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.source,)) as pool:
            pending: Deque = collections.deque()
            for chunk in _chunks(docs, CHUNK_CHARS):
                pending.append((pool.apply_async(_encode_chunk, (chunk,)), sum(len(d) for d in chunk)))
                while len(pending) > 2 * workers:  # bounded: the corpus never sits in memory whole
                    res, n = pending.popleft()
                    yield from res.get()
                    stats["chars"] += n
                    bar.update(n)
            while pending:
                res, n = pending.popleft()
                yield from res.get()
                stats["chars"] += n
                bar.update(n)
    finally:
        bar.close()


def _total_chars(inputs: Sequence[str]) -> Optional[int]:
    if any(i.startswith("embedded:") for i in inputs):
        return None
    return sum(f.stat().st_size for f in list_files(inputs))


def prepare(inputs: Sequence[str], prefix: Path, tokenizer: Tokenizer, source: str = "", workers: int = 1,
            progress: bool = False, json_key: str = "text") -> dict:
    """Tokenize ``inputs`` into PREFIX.bin/.idx/.meta.json unless a complete shard is already there."""
    list_files(inputs)  # fail on a missing input before taking the lock

    def build() -> dict:
        stats: dict = {}
        docs = tokenize_docs(iter_inputs(inputs, json_key), tokenizer, workers, progress, _total_chars(inputs), stats)
        return write_shard(prefix, docs, tokenizer, source or ",".join(inputs), {"workers": workers}, stats)

    return ensure_shard(prefix, build)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmforge data prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="files, directories, *.jsonl, or embedded:books|code|reference")
    ap.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json)")
    ap.add_argument("--tokenizer", default="embedded",
                    help="embedded | path/to/tokenizer.json | tiktoken:/path/NAME.tiktoken | tiktoken:NAME")
    ap.add_argument("--cache-dir", default=os.environ.get("LMFORGE_DATA_CACHE", ".cache/lmforge-data"),
                    help="where the embedded tokenizer lives (default $LMFORGE_DATA_CACHE)")
    ap.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="tokenizer processes (default: half the cores, at most 8)")
    ap.add_argument("--json-key", default="text", help="the JSONL field holding the document text")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                    help="show a progress bar (default: when stderr is a terminal)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete shard exists")
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.tokenizer, Path(args.cache_dir))
    out = Path(args.out)
    if out.suffix in (".bin", ".idx"):
        raise SystemExit(f"--out is a prefix, without .bin/.idx: use --out {out.with_suffix('')}")
    if args.force:
        from lmforge.data.shards import meta_path

        meta_path(out).unlink(missing_ok=True)
    meta = prepare(args.inputs, out, tok, workers=args.workers, progress=args.progress, json_key=args.json_key)
    print(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

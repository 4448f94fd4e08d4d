"""Tokenize text into Megatron shards: ``python -m lmforge.data.prepare`` / ``lmforge data prepare``.

Inputs: text files, directories of them, JSONL files (a ``text`` field per line), or ``embedded:NAME``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator, List, Sequence

from lmforge.data.shards import ensure_shard, write_shard
from lmforge.data.tokenizer import Tokenizer, load_tokenizer

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".go", ".c", ".h", ".json", ""}


def iter_inputs(inputs: Sequence[str]) -> Iterator[str]:
    from lmforge.data.embedded import iter_documents

    for item in inputs:
        if item.startswith("embedded:"):
            yield from iter_documents(item.split(":", 1)[1])
            continue
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"input '{item}' does not exist. Fix: give existing files, directories or embedded:NAME")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if f.suffix == ".jsonl":
                with open(f, encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            try:
                                yield json.loads(line)["text"]
                            except (ValueError, KeyError):
                                raise ValueError(f"{f}:{n}: not a JSON object with a 'text' field") from None
            elif f.suffix in TEXT_SUFFIXES or path == f:
                text = f.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    yield text


def tokenize_docs(docs: Iterator[str], tokenizer: Tokenizer, chunk: int = 256) -> Iterator[List[int]]:
    buf: List[str] = []
    for doc in docs:
        buf.append(doc)
        if len(buf) >= chunk:
            yield from tokenizer.encode_batch(buf)
            buf = []
    if buf:
        yield from tokenizer.encode_batch(buf)


def prepare(inputs: Sequence[str], prefix: Path, tokenizer: Tokenizer, source: str = "") -> dict:
    return ensure_shard(prefix, lambda: write_shard(prefix, tokenize_docs(iter_inputs(inputs), tokenizer), tokenizer,
                                                    source or ",".join(inputs)))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmforge data prepare", description=__doc__)
    ap.add_argument("inputs", nargs="+", help="files, directories, *.jsonl, or embedded:books|code|reference")
    ap.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json)")
    ap.add_argument("--tokenizer", default="embedded", help="embedded | path/to/tokenizer.json | tiktoken:NAME")
    ap.add_argument("--cache-dir", default=".cache/lmforge-data")
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.tokenizer, Path(args.cache_dir))
    meta = prepare(args.inputs, Path(args.out), tok)
    print(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

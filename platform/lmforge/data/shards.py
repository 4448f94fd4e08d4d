"""Megatron indexed shards (PREFIX.bin / PREFIX.idx) plus a JSON sidecar (PREFIX.meta.json).

Written with megatron-core's ``IndexedDatasetBuilder`` to temporary names, then renamed into place; the
sidecar is renamed last, so a shard without its sidecar is incomplete and never used. A file lock
serialises concurrent builders of the same prefix (several ranks, several jobs on a shared filesystem).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, List

import numpy as np

from lmforge.data.tokenizer import Tokenizer


def meta_path(prefix: Path) -> Path:
    return Path(str(prefix) + ".meta.json")


def token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_shard(prefix: Path, token_docs: Iterable[List[int]], tokenizer: Tokenizer, source: str) -> dict:
    """Write documents (already tokenized, without EOD) with an EOD appended to each."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{prefix}.tmp{os.getpid()}")
    dtype = token_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    n_docs = n_tokens = 0
    for ids in token_docs:
        ids = list(ids) + [tokenizer.eod]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
        n_docs += 1
        n_tokens += len(ids)
    builder.finalize(f"{tmp}.idx")
    meta = {"source": source, "documents": n_docs, "tokens": n_tokens, "dtype": np.dtype(dtype).name,
            "tokenizer": tokenizer.identity}
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    tmp_meta = Path(f"{tmp}.meta.json")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path(prefix))
    return meta


def ensure_shard(prefix: Path, build: Callable[[], dict]) -> dict:
    """Build the shard once (under a lock) unless a complete one exists; return its sidecar."""
    with file_lock(Path(str(prefix) + ".lock")):
        if meta_path(prefix).exists():
            return json.loads(meta_path(prefix).read_text())
        return build()


def read_meta(prefix: Path) -> dict:
    return json.loads(meta_path(prefix).read_text())

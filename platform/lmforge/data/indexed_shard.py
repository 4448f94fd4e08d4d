"""Megatron indexed shards (PREFIX.bin / PREFIX.idx) plus a JSON sidecar (PREFIX.meta.json).

Written with megatron-core's ``IndexedDatasetBuilder`` to temporary names, then renamed into place; the
sidecar is renamed last, so a shard without its sidecar is incomplete and never used. A file lock
serialises concurrent builders of the same prefix (several ranks, several jobs on a shared filesystem).

The .idx layout (megatron-core ``_IndexReader``): 9-byte magic ``MMIDIDX\\0\\0``, u64 version (1), u8 dtype
code, u64 sequence count S, u64 document count D, then int32 lengths[S], int64 byte pointers[S] and
int64 document indices[D]. :func:`read_index` parses it without megatron so a bad shard gets a clear error.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np

from lmforge.data.file_lock import file_lock
from lmforge.data.megatron_import import quiet_megatron_import
from lmforge.data.tokenizer import Tokenizer

INDEX_MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
# megatron-core's DType codes.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def meta_path(prefix: Path) -> Path:
    return Path(str(prefix) + ".meta.json")


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab <= 65536), else int32."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


@dataclass
class IndexInfo:
    dtype: type
    lengths: np.ndarray  # int32 [S], one sequence per document for lmforge shards
    doc_index: np.ndarray  # int64 [D+1]
    idx_bytes: int
    expected_idx_bytes: int
    expected_bin_bytes: int

    @property
    def num_documents(self) -> int:
        return len(self.doc_index) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))


class ShardFormatError(ValueError):
    pass


def read_index(idx_path: Path) -> IndexInfo:
    raw = Path(idx_path).read_bytes()
    if len(raw) < HEADER_BYTES or raw[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise ShardFormatError(f"{idx_path} is not a Megatron index (no MMIDIDX header)")
    version, code, s_count, d_count = struct.unpack_from("<QBQQ", raw, len(INDEX_MAGIC))
    if version != 1 or code not in DTYPE_CODES:
        raise ShardFormatError(f"{idx_path}: unsupported index version {version} / dtype code {code}")
    expected = HEADER_BYTES + 4 * s_count + 8 * s_count + 8 * d_count
    if len(raw) < expected:
        raise ShardFormatError(f"{idx_path} is truncated: {len(raw)} bytes, its header describes {expected}")
    lengths = np.frombuffer(raw, dtype=np.int32, count=s_count, offset=HEADER_BYTES)
    docs = np.frombuffer(raw, dtype=np.int64, count=d_count, offset=HEADER_BYTES + 12 * s_count)
    dtype = DTYPE_CODES[code]
    return IndexInfo(
        dtype, lengths, docs, len(raw), expected, int(lengths.sum(dtype=np.int64)) * np.dtype(dtype).itemsize
    )


def max_token_id(bin_path: Path, dtype: type, chunk_tokens: int = 1 << 24) -> int:
    data = np.memmap(bin_path, dtype=dtype, mode="r")
    best = -1
    for start in range(0, len(data), chunk_tokens):
        best = max(best, int(data[start : start + chunk_tokens].max()))
    return best


def write_shard(
    prefix: Path,
    token_docs: Iterable[Sequence[int]],
    tokenizer: Tokenizer,
    source: str,
    extra_meta: Union[None, dict, Callable[[], dict]] = None,
    stats: Optional[dict] = None,
) -> dict:
    """Write documents (already tokenized, without EOD) with an EOD appended to each.

    ``extra_meta`` (a dict, or a function called once the documents are consumed) adds sidecar fields.

    ``stats["chars"]``, when the producer fills it, gives the text throughput recorded in the sidecar.
    """
    with quiet_megatron_import():
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{prefix}.tmp{os.getpid()}")
    dtype = token_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    n_docs = n_tokens = 0
    top = -1
    t0 = time.perf_counter()
    for ids in token_docs:
        arr = np.empty(len(ids) + 1, dtype=dtype)  # the ids and the EOD, converted once, into the shard's dtype
        arr[:-1] = ids
        arr[-1] = tokenizer.eod
        top = max(top, int(arr.max()))
        builder.add_document(arr, [len(arr)])
        n_docs += 1
        n_tokens += len(arr)
    if n_docs == 0:
        builder.data_file.close()
        os.unlink(f"{tmp}.bin")
        raise ValueError(
            f"no documents to write for {prefix} (inputs: {source}): every input was empty. "
            "Fix: check the input paths, the JSONL 'text' field, and the file suffixes"
        )
    builder.finalize(f"{tmp}.idx")
    seconds = time.perf_counter() - t0
    chars = (stats or {}).get("chars")
    if callable(extra_meta):
        extra_meta = extra_meta()
    meta = {
        "source": source,
        "documents": n_docs,
        "tokens": n_tokens,
        "dtype": np.dtype(dtype).name,
        "max_token_id": top,
        "bin_bytes": os.path.getsize(f"{tmp}.bin"),
        "tokenizer": tokenizer.identity,
        "seconds": round(seconds, 3),
        "text_chars": chars,
        "text_mb_per_s": round(chars / 1e6 / max(seconds, 1e-9), 3) if chars else None,
        **(extra_meta or {}),
    }
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


def read_meta(prefix: Path) -> Optional[dict]:
    path = meta_path(prefix)
    return json.loads(path.read_text()) if path.exists() else None

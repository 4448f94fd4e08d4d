"""Checks on the data before any index is built or step is taken: every bad input gets its own error.

Each failure is a :class:`ConfigError` naming the config key (and the file), the reason and the fix:
missing prefix / .bin / .idx, a truncated or corrupt shard, negative or all-zero weights, a shard
tokenized with another tokenizer, token ids outside the vocabulary, a train/valid split that receives
no documents (megatron-core's index builder would loop forever on it), and a split too short to serve
one sequence of ``seq_len + 1`` tokens.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from lmforge.config.errors import ConfigError
from lmforge.data.indexed_shard import IndexInfo, ShardFormatError, max_token_id, read_index, read_meta
from lmforge.data.megatron_import import quiet_megatron_import
from lmforge.data.tokenizer import Tokenizer

PREPARE_FIX = "re-run `lmforge data prepare INPUTS --out PREFIX` (see docs/data.md)"


@dataclass
class ShardInfo:
    name: str
    prefix: Path
    index: IndexInfo
    meta: Optional[dict]
    max_token_id: int


def normalise_weights(raw: Mapping[str, float]) -> Tuple[List[str], List[float], Optional[str]]:
    """Sources with a positive weight, their weights scaled to sum to 1, and a note when anything changed."""
    for name, w in raw.items():
        if not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ConfigError(
                f"data.sources.{name}.weight",
                f"must be a finite number, got {w!r}",
                "give a weight >= 0 (weights are normalised to sum to 1)",
            )
        if w < 0:
            raise ConfigError(
                f"data.sources.{name}.weight",
                f"is negative ({w})",
                "give a weight >= 0 (weights are normalised to sum to 1; 0 leaves the source out)",
            )
    positive = {n: float(w) for n, w in raw.items() if w > 0}
    if not positive:
        listed = ", ".join(f"{n}={w}" for n, w in raw.items()) or "no sources"
        raise ConfigError(
            "data.sources",
            f"every weight is zero ({listed}): nothing to train on",
            "give at least one source a positive weight",
        )
    total = sum(positive.values())
    names = list(positive)
    # Weights that already sum to 1 are used as given (no float noise from dividing by 0.9999999999999999).
    weights = [positive[n] if abs(total - 1.0) <= 1e-9 else positive[n] / total for n in names]
    note = None
    dropped = [n for n in raw if n not in positive]
    if abs(total - 1.0) > 1e-9 or dropped:
        note = (
            "data: weights "
            + ", ".join(f"{n}={raw[n]:g}" for n in raw)
            + " normalised to "
            + ", ".join(f"{n}={w:.4f}" for n, w in zip(names, weights))
            + (f"; weight 0 leaves out {', '.join(dropped)}" if dropped else "")
        )
    return names, weights, note


def check_prefix_exists(name: str, prefix: Path) -> None:
    """Refuse a shard prefix with neither its .bin nor its .idx (or one given with its suffix)."""
    key = f"data.sources.{name}.path"
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if prefix.suffix in (".bin", ".idx") and not bin_path.exists() and not idx_path.exists():
        raise ConfigError(
            key, f"'{prefix}' names a file, but the path is a prefix", f"drop the suffix: {prefix.with_suffix('')}"
        )
    if not bin_path.exists() and not idx_path.exists():
        raise ConfigError(
            key,
            f"no Megatron shard at prefix {prefix} (neither {bin_path.name} nor {idx_path.name} exists)",
            f"fix the prefix, or create it: {PREPARE_FIX}",
        )


def check_shard(name: str, prefix: Path, tokenizer: Tokenizer) -> ShardInfo:
    key = f"data.sources.{name}.path"
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    check_prefix_exists(name, prefix)
    for have, missing in ((bin_path, idx_path), (idx_path, bin_path)):
        if have.exists() and not missing.exists():
            raise ConfigError(
                key, f"{missing} is missing (only {have.name} exists): the shard is incomplete", PREPARE_FIX
            )
    try:
        index = read_index(idx_path)
    except ShardFormatError as e:
        raise ConfigError(key, f"{e}: the shard is corrupt", PREPARE_FIX) from None
    if index.idx_bytes != index.expected_idx_bytes:
        raise ConfigError(
            key,
            f"{idx_path} has {index.idx_bytes} bytes but its header describes "
            f"{index.expected_idx_bytes}: the index is corrupt",
            PREPARE_FIX,
        )
    bin_bytes = os.path.getsize(bin_path)
    if bin_bytes != index.expected_bin_bytes:
        what = "truncated" if bin_bytes < index.expected_bin_bytes else "longer than its index (corrupt)"
        raise ConfigError(
            key,
            f"{bin_path} has {bin_bytes} bytes but {idx_path.name} describes "
            f"{index.expected_bin_bytes} ({index.num_tokens} tokens of {np.dtype(index.dtype).name}): "
            f"the shard is {what}",
            PREPARE_FIX,
        )
    if index.num_documents < 1 or len(index.lengths) < 1:
        raise ConfigError(key, f"shard {prefix} holds no documents", PREPARE_FIX)
    meta = read_meta(prefix)
    top = None
    if meta is not None:
        want, have = tokenizer.identity, meta.get("tokenizer", {})
        if have.get("fingerprint") != want["fingerprint"] or have.get("vocab_size") != want["vocab_size"]:
            raise ConfigError(
                key,
                f"shard {prefix} was tokenized with {_describe(have)}, but this run's tokenizer "
                f"(data.tokenizer) is {_describe(want)}",
                "re-prepare the shard with the run's tokenizer (lmforge data prepare --tokenizer ...), "
                "or set data.tokenizer to the one the shard was made with",
            )
        if meta.get("bin_bytes") not in (None, bin_bytes):
            raise ConfigError(
                key,
                f"{bin_path} has {bin_bytes} bytes but {prefix}.meta.json recorded "
                f"{meta['bin_bytes']}: the shard changed after it was prepared",
                PREPARE_FIX,
            )
        top = meta.get("max_token_id")
    if top is None:  # a shard from another tool (Megatron-LM, NeMo, GPT-NeoX): scan it once
        top = max_token_id(bin_path, index.dtype)
    if top >= tokenizer.vocab_size:
        raise ConfigError(
            key,
            f"shard {prefix} contains token id {top}, but the tokenizer's vocabulary has "
            f"{tokenizer.vocab_size} ids (0..{tokenizer.vocab_size - 1}) — it was made with another "
            "vocabulary",
            "re-prepare the shard with the run's tokenizer, or use the matching data.tokenizer and model.vocab_size",
        )
    return ShardInfo(name, prefix, index, meta, int(top))


def _describe(identity: dict) -> str:
    if not identity:
        return "an unknown tokenizer"
    return (
        f"{identity.get('kind')} tokenizer (vocab {identity.get('vocab_size')}, eod {identity.get('eod')}, "
        f"fingerprint {identity.get('fingerprint')})"
    )


def split_string(valid_fraction: float) -> str:
    """megatron-core's split string for a train/valid split of each source's documents."""
    valid = max(1, round(valid_fraction * 10000))
    return f"{10000 - valid},{valid},0"


def split_bounds(num_docs: int, split: str) -> Dict[str, Tuple[int, int]]:
    """Document ranges per split, computed exactly as megatron-core's builder does."""
    with quiet_megatron_import():
        from megatron.core.datasets.blended_megatron_dataset_config import (
            convert_split_vector_to_split_matrix,
            parse_and_normalize_split,
        )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    out = {}
    for label, bounds in zip(("train", "valid"), matrix[:2]):
        if bounds is not None:
            out[label] = (int(round(bounds[0] * float(num_docs))), int(round(bounds[1] * float(num_docs))))
    return out


def check_splits(shard: ShardInfo, valid_fraction: float, seq_len: int) -> Dict[str, int]:
    """Every split must get >= 1 document and >= seq_len + 1 tokens; returns the tokens per split."""
    n_docs = len(shard.index.lengths)  # GPTDataset splits sequences (one per document in lmforge shards)
    tokens = {}
    for label, (beg, end) in split_bounds(n_docs, split_string(valid_fraction)).items():
        if end <= beg:
            split = split_string(valid_fraction)
            need = next(
                (n for n in range(1, 100_001) if all(e > b for b, e in split_bounds(n, split).values())),
                math.ceil(1 / min(valid_fraction, 1 - valid_fraction)),
            )
            raise ConfigError(
                "data.valid_fraction",
                f"source '{shard.name}' ({shard.prefix}) has {n_docs} documents; valid_fraction="
                f"{valid_fraction} leaves its {label} split with 0 documents (megatron-core's index "
                "builder would loop forever on it)",
                f"give '{shard.name}' at least {need} documents, or change data.valid_fraction so both splits get one",
            )
        tokens[label] = int(shard.index.lengths[beg:end].sum(dtype=np.int64))
        if tokens[label] < seq_len + 1:
            raise ConfigError(
                "model.seq_len",
                f"the {label} split of source '{shard.name}' ({shard.prefix}) has only "
                f"{tokens[label]} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}",
                f"use a seq_len below {tokens[label]}, add documents to '{shard.name}', or raise data.valid_fraction"
                if label == "valid"
                else f"use a seq_len below {tokens[label]} or add documents to '{shard.name}'",
            )
    return tokens

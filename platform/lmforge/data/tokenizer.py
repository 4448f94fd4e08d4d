"""Tokenizers with a stable identity: a byte-level BPE trained locally, a tokenizer.json, or tiktoken files.

Nothing is downloaded. ``identity`` (kind, vocab size, end-of-document id, sha256 of the full serialized
tokenizer) is written beside every prepared shard, so a shard tokenized differently from the model is
refused, not trained on.

Specs understood by :func:`load_tokenizer`:

- ``embedded``: a byte-level BPE trained once on the embedded corpora and cached in the data cache dir;
- ``path/to/tokenizer.json``: any HF ``tokenizers`` file that has an ``<|endoftext|>`` token;
- ``tiktoken:/path/to/NAME.tiktoken``: a tiktoken rank file read from local disk (the end-of-text token
  takes the first id the ranks leave free: 50256 for GPT-2's file);
- ``tiktoken:NAME``: a named tiktoken encoding whose file is already in ``$TIKTOKEN_CACHE_DIR``
  (network access is blocked while loading, so a missing file is an error, never a download).

The files are read by ``lmforge.config.tokenizer_files``, which also gives ``vocab_size_of(spec)``: the
vocabulary ``validate()`` checks against ``model.vocab_size`` before any data or process group exists.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from lmforge.config.tokenizer_files import (
    EMBEDDED_VOCAB,
    EOD_TOKEN,
    end_of_text_id,
    named_tiktoken,
    read_tiktoken_ranks,
    read_tokenizer_json,
    tiktoken_file_of,
    vocab_size_of,
)
from lmforge.data.embedded import SOURCES, VERSION, iter_documents
from lmforge.data.file_lock import file_lock
from lmforge.data.notices import first_use_notice

__all__ = [
    "EMBEDDED_VOCAB",
    "EOD_TOKEN",
    "Tokenizer",
    "build_embedded_tokenizer",
    "embedded_tokenizer_path",
    "export_tiktoken",
    "load_tokenizer",
    "train_bpe",
    "vocab_size_of",
]

# GPT-2 / r50k pre-tokenisation, the same split HF's ByteLevel pre-tokenizer applies.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@dataclass
class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` (or tiktoken) with the facts the platform needs."""

    backend: object
    kind: str
    eod: int
    vocab_size: int
    fingerprint: str
    source: str = ""  # a spec load_tokenizer() accepts: how worker processes rebuild this tokenizer

    def encode(self, text: str) -> List[int]:
        if self.kind == "tiktoken":
            return self.backend.encode_ordinary(text)
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        if self.kind == "tiktoken":
            return self.backend.encode_ordinary_batch(texts, num_threads=1)
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids))

    @property
    def identity(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eod": self.eod, "fingerprint": self.fingerprint}


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path) -> Path:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation) and save ``tokenizer.json`` atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens plus "
            f"'{EOD_TOKEN}'. Fix: use a vocab size >= 258 (e.g. 8192)"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, out_path)
    return out_path


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _from_tokenizer_json(path: Path) -> Tokenizer:
    backend = read_tokenizer_json(path)
    digest = _sha(backend.to_str().encode())
    return Tokenizer(
        backend, "hf", backend.token_to_id(EOD_TOKEN), backend.get_vocab_size(with_added_tokens=True), digest, str(path)
    )


def _tiktoken_identity(ranks: Dict[bytes, int], pattern: str, special: Dict[str, int]) -> str:
    h = hashlib.sha256(pattern.encode())
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(tok) + b" %d\n" % rank)
    h.update(json.dumps(sorted(special.items())).encode())
    return h.hexdigest()[:16]


def _tiktoken_from_file(path: Path) -> Tokenizer:
    import tiktoken

    ranks = read_tiktoken_ranks(path)
    eod = end_of_text_id(ranks)
    special = {EOD_TOKEN: eod}
    enc = tiktoken.Encoding(path.stem, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)
    return Tokenizer(
        enc, "tiktoken", eod, enc.n_vocab, _tiktoken_identity(ranks, GPT2_PATTERN, special), f"tiktoken:{path}"
    )


def _tiktoken_named(name: str) -> Tokenizer:
    enc = named_tiktoken(name)
    special = dict(enc._special_tokens)
    digest = _tiktoken_identity(enc._mergeable_ranks, enc._pat_str, special)
    return Tokenizer(enc, "tiktoken", enc.eot_token, enc.n_vocab, digest, f"tiktoken:{name}")


def export_tiktoken(tokenizer_json: Path, out_path: Path) -> Path:
    """Write a byte-level BPE tokenizer.json as a tiktoken rank file with the same token ids.

    Byte-level BPE stores token bytes through GPT-2's byte-to-unicode table; invert it. Special tokens
    are left out (tiktoken keeps them apart); ``<|endoftext|>`` gets its id back when the file is loaded.
    """
    data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    vocab: Dict[str, int] = data["model"]["vocab"]
    specials = {t["content"] for t in data.get("added_tokens", [])}
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    byte_of: Dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_of[chr(256 + extra)] = b
            extra += 1
    lines = []
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token in specials:
            continue
        raw = bytes(byte_of[ch] for ch in token)
        lines.append(base64.b64encode(raw).decode() + f" {idx}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out_path)
    return out_path


def embedded_tokenizer_path(cache_dir: Path, vocab_size: int = EMBEDDED_VOCAB) -> Path:
    return cache_dir / "tokenizers" / f"embedded-bpe-{vocab_size}-v{VERSION}.json"


def build_embedded_tokenizer(cache_dir: Path, vocab_size: int = EMBEDDED_VOCAB) -> Path:
    """Train (once, cached, under a lock) a BPE on a fixed sample of the embedded corpora."""
    path = embedded_tokenizer_path(cache_dir, vocab_size)
    if path.exists():
        return path
    first_use_notice(f"training the embedded tokenizer, a byte-level BPE of {vocab_size} tokens", path)

    def sample() -> Iterable[str]:
        for name in SOURCES:
            budget = 1_500_000
            for doc in iter_documents(name):
                yield doc
                budget -= len(doc)
                if budget <= 0:
                    break

    with file_lock(path.with_suffix(".lock")):
        if path.exists():
            return path
        return train_bpe(sample(), vocab_size, path)


def load_tokenizer(spec: str, cache_dir: Optional[Path] = None) -> Tokenizer:
    """``embedded`` | ``tiktoken:NAME`` | ``tiktoken:/path/FILE.tiktoken`` | path to a tokenizer.json."""
    if spec == "embedded":
        if cache_dir is None:
            raise ValueError("the embedded tokenizer needs a cache_dir to live in")
        return _from_tokenizer_json(build_embedded_tokenizer(cache_dir))
    if spec.startswith("tiktoken:"):
        path = tiktoken_file_of(spec)
        return _tiktoken_named(spec.split(":", 1)[1]) if path is None else _tiktoken_from_file(path)
    return _from_tokenizer_json(Path(spec).expanduser())

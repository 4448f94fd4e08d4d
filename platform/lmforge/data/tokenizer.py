"""Tokenizers with a stable identity: a byte-level BPE trained locally, a tokenizer.json, or tiktoken files.

Nothing is downloaded. ``identity`` (kind, vocab size, sha256 of the serialized vocabulary) is written
beside every prepared shard, so a shard tokenized differently from the model is refused, not trained on.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

EOD_TOKEN = "<|endoftext|>"
EMBEDDED_VOCAB = 8192


@dataclass
class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` (or tiktoken) with the facts the platform needs."""

    backend: object
    kind: str
    eod: int
    vocab_size: int
    fingerprint: str
    source: str = ""

    def encode(self, text: str) -> List[int]:
        if self.kind == "tiktoken":
            return self.backend.encode_ordinary(text)
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        if self.kind == "tiktoken":
            return self.backend.encode_ordinary_batch(texts)
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

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, out_path)
    return out_path


def _from_tokenizer_json(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer.json at {path}. Fix: give an existing path, "
                                "'embedded', or 'tiktoken:NAME'")
    backend = HFTokenizer.from_file(str(path))
    eod = backend.token_to_id(EOD_TOKEN)
    if eod is None:
        raise ValueError(f"data.tokenizer: {path} has no '{EOD_TOKEN}' token to end documents with. "
                         "Fix: add it as a special token when training the tokenizer")
    vocab = backend.get_vocab(with_added_tokens=True)
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return Tokenizer(backend, "hf", eod, backend.get_vocab_size(with_added_tokens=True), digest, str(path))


def _from_tiktoken(name: str) -> Tokenizer:
    import tiktoken

    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # tiktoken raises plain exceptions when the file is not cached
        raise ValueError(
            f"data.tokenizer: tiktoken encoding '{name}' could not be loaded offline ({type(e).__name__}). Fix: put its "
            "file in $TIKTOKEN_CACHE_DIR (see docs/data.md)"
        ) from None
    digest = hashlib.sha256(repr(sorted(enc._mergeable_ranks.items())[:1000]).encode()).hexdigest()[:16]
    return Tokenizer(enc, "tiktoken", enc.eot_token, enc.n_vocab, digest, f"tiktoken:{name}")


def embedded_tokenizer_path(cache_dir: Path, vocab_size: int = EMBEDDED_VOCAB) -> Path:
    return cache_dir / "tokenizers" / f"embedded-bpe-{vocab_size}.json"


def build_embedded_tokenizer(cache_dir: Path, vocab_size: int = EMBEDDED_VOCAB) -> Path:
    """Train (once, cached) a BPE on a fixed sample of the embedded corpora."""
    from lmforge.data.embedded import SOURCES, iter_documents

    path = embedded_tokenizer_path(cache_dir, vocab_size)
    if path.exists():
        return path

    def sample() -> Iterable[str]:
        for name in SOURCES:
            budget = 1_500_000
            for doc in iter_documents(name):
                yield doc
                budget -= len(doc)
                if budget <= 0:
                    break

    return train_bpe(sample(), vocab_size, path)


def load_tokenizer(spec: str, cache_dir: Optional[Path] = None) -> Tokenizer:
    """``embedded`` | ``tiktoken:NAME`` | path to a tokenizer.json."""
    if spec == "embedded":
        if cache_dir is None:
            raise ValueError("the embedded tokenizer needs a cache_dir to live in")
        return _from_tokenizer_json(build_embedded_tokenizer(cache_dir))
    if spec.startswith("tiktoken:"):
        return _from_tiktoken(spec.split(":", 1)[1])
    return _from_tokenizer_json(Path(spec).expanduser())

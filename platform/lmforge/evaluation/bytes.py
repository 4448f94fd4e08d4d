"""Bits per byte: a tokenizer-independent loss, so runs with different tokenizers compare.

    bpb = loss_nats_per_token * tokens / bytes / ln 2

where ``bytes`` are the UTF-8 bytes the scored tokens decode to. ``token_byte_lengths`` gives that count per token
id: exact for byte-level BPE (tokenizer.json with a ByteLevel decoder: each character of a token's string stands
for one byte) and tiktoken (each token's own bytes); for other tokenizers the UTF-8 length of each token decoded
alone (a token that is part of a multi-byte character counts its replacement character). Special tokens (the
end-of-document token) are 0 bytes: they are in the loss but are no text.
"""
from __future__ import annotations

import json
import math

import torch

LN2 = math.log(2.0)


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64: the UTF-8 bytes each token id stands for (0 for special and unused ids)."""
    out = torch.zeros(vocab_size, dtype=torch.int64)
    backend = tokenizer.backend
    n = min(vocab_size, tokenizer.vocab_size)
    if tokenizer.kind == "tiktoken":
        for i in range(n):
            try:
                out[i] = len(backend.decode_single_token_bytes(i))
            except KeyError:  # an id the encoding does not use
                pass
        out[tokenizer.eod] = 0
        return out
    spec = json.loads(backend.to_str())
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    for i in range(n):
        if i in special:
            continue
        token = backend.id_to_token(i)
        if token is None:
            continue
        out[i] = len(token) if byte_level else len(backend.decode([i]).encode("utf-8"))
    out[tokenizer.eod] = 0
    return out


def bits_per_byte(loss_nats: float, tokens: int, n_bytes: int) -> float:
    return loss_nats * tokens / n_bytes / LN2 if n_bytes else float("nan")

"""Bits per byte: a tokenizer-independent loss, so runs with different tokenizers compare.

    bpb = loss_nats_per_token * tokens / bytes / ln 2

where ``bytes`` are the UTF-8 bytes the scored tokens decode to. ``token_byte_lengths`` gives that count per token
id: exact for byte-level BPE (tokenizer.json with a ByteLevel decoder: each character of a token's string stands
for one byte) and tiktoken (each token's own bytes); for other tokenizers the UTF-8 length of each token decoded
alone (a token that is part of a multi-byte character counts its replacement character). Special tokens (the
end-of-document token) are 0 bytes: they are in the loss but are no text.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64: the UTF-8 bytes each token id stands for (0 for special and unused ids)."""
    lengths = [0] * vocab_size
    backend = tokenizer.backend
    n = min(vocab_size, tokenizer.vocab_size)
    if tokenizer.kind == "tiktoken":
        for i in range(n):
            try:
                lengths[i] = len(backend.decode_single_token_bytes(i))
            except KeyError:  # an id the encoding does not use
                pass
    else:
        from tokenizers import decoders

        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i < n and i not in special:
                lengths[i] = len(token) if byte_level else len(backend.decode([i]).encode("utf-8"))
    lengths[tokenizer.eod] = 0
    return torch.tensor(lengths, dtype=torch.int64)


def bits_per_byte(loss_nats: float, tokens: int, n_bytes: int) -> float:
    return loss_nats * tokens / n_bytes / LN2 if n_bytes else float("nan")

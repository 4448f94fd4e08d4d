"""Choosing the next token from logits: greedy (temperature 0) or sampling with temperature, top-k and top-p.

Sampling draws from a ``torch.Generator`` seeded by the caller, so a seed reproduces a generation exactly (for
the same batch: rows share the generator's stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class GenerationError(ValueError):
    """Bad generation input (a parameter out of range, a prompt too long): one line with the fix."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: Optional[int] = None  # keep the k most likely tokens
    top_p: Optional[float] = None  # keep the smallest set of tokens whose probability reaches p (nucleus)
    seed: int = 0

    def check(self) -> None:
        if not self.temperature >= 0:
            raise GenerationError(f"temperature {self.temperature}: must be >= 0 (0 = greedy). Fix: pass 0 or more")
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(f"top_k {self.top_k}: must be >= 1. Fix: pass a positive k or leave it unset")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p {self.top_p}: must be in (0, 1]. Fix: pass e.g. 0.9 or leave it unset")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """[B, V] logits with every token outside top-k / top-p set to -inf (the most likely token always stays)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the more likely tokens
        drop = before >= top_p
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: Optional[torch.Generator]) -> torch.Tensor:
    """[B, V] logits of the last position -> [B] next token ids."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)

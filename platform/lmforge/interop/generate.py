"""Greedy decoding for lmforge's GPT (no KV cache: the whole prefix is re-run each step; for checks, not serving)."""
from __future__ import annotations

from typing import List, Optional

import torch


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompt: List[int], max_new_tokens: int,
                    eos_token_id: Optional[int] = None) -> List[int]:
    """Append the argmax token ``max_new_tokens`` times (stopping after ``eos_token_id``, like HF ``generate``)."""
    seq_limit = model.cfg.seq_len
    ids = list(prompt)
    for _ in range(max_new_tokens):
        window = ids[-seq_limit:]
        logits = model(torch.tensor([window], dtype=torch.long))
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        if eos_token_id is not None and nxt == eos_token_id:
            break
    return ids[len(prompt):]

"""Batched generation: one prefill over the (left-padded) prompts, then one cached forward per new token.

    generate(model, prompts, max_new_tokens, temperature=..., top_k=..., top_p=..., seed=..., eos_token_id=...,
             stop=[[ids], ...]) -> one list of new token ids per prompt

A row stops after it emits ``eos_token_id`` or completes one of the ``stop`` token sequences (both kept at the end
of its output, as ``transformers``' ``generate`` keeps EOS), or when ``stop_when(row_ids)`` says so (text-level
stop strings: decode and look); the batch stops when every row has. ``use_cache=False`` recomputes the whole
prefix of each row on every step, one row at a time: the reference the cache is checked against, and the
baseline of ``benchmarks/decode.py``.

The model is lmforge's single-process ``GPT`` (``lmforge.interop.generate.load_for_generation`` builds it from a
checkpoint of any layout). Prompt + ``max_new_tokens`` must fit ``model.seq_len`` (the RoPE tables it trained with).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from lmforge.generation.kv_cache import KVCache
from lmforge.generation.sampling import GenerationError, Sampling, next_tokens


def _check(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    cfg = model.cfg
    if not prompts:
        raise GenerationError("no prompts. Fix: pass at least one prompt (a list of token ids)")
    if max_new_tokens < 0:
        raise GenerationError(f"max_new_tokens {max_new_tokens}: must be >= 0")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerationError(f"prompt {i} is empty. Fix: start it with a token (e.g. the tokenizer's EOD)")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise GenerationError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
        if len(p) + max_new_tokens > cfg.seq_len:
            raise GenerationError(
                f"prompt {i} ({len(p)} tokens) + max_new_tokens {max_new_tokens} exceeds the "
                f"model's context (model.seq_len={cfg.seq_len}). Fix: shorten the prompt (keep "
                f"its last tokens) or ask for fewer new tokens"
            )


def _ends_with(ids: List[int], stop: Sequence[Sequence[int]]) -> bool:
    return any(len(s) > 0 and len(ids) >= len(s) and ids[-len(s) :] == list(s) for s in stop)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 0,
    eos_token_id: Optional[int] = None,
    stop: Sequence[Sequence[int]] = (),
    stop_when: Optional[Callable[[List[int]], bool]] = None,
    use_cache: bool = True,
) -> List[List[int]]:
    """New token ids for each prompt (token id lists of any lengths). Greedy at ``temperature`` 0 (default)."""
    sampling = Sampling(temperature, top_k, top_p, seed)
    sampling.check()
    _check(model, prompts, max_new_tokens)
    device = model.rope.cos.device
    generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(seed)
    outs: List[List[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outs

    def finished(row: List[int]) -> bool:
        return (
            (eos_token_id is not None and row[-1] == eos_token_id)
            or _ends_with(row, stop)
            or (stop_when is not None and stop_when(row))
        )

    if not use_cache:
        for i, prompt in enumerate(prompts):
            ids = list(prompt)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids], device=device))[:, -1]
                ids.append(int(next_tokens(logits, sampling, generator)[0]))
                outs[i].append(ids[-1])
                if finished(outs[i]):
                    break
        return outs

    longest = max(len(p) for p in prompts)
    pad = [longest - len(p) for p in prompts]
    dtype = next(model.parameters()).dtype
    # The last new token is never fed back: its K/V are never needed.
    cache = KVCache(model.cfg, len(prompts), longest + max_new_tokens - 1, dtype, device, pad)
    x = torch.tensor([[0] * n + list(p) for n, p in zip(pad, prompts)], dtype=torch.long, device=device)
    done = [False] * len(prompts)
    for _ in range(max_new_tokens):
        cache.begin(x.shape[1], model.rope.cos, model.rope.sin)
        logits = model(x, kv_cache=cache)[:, -1]
        cache.commit()
        nxt = next_tokens(logits, sampling, generator)
        for i, t in enumerate(nxt.tolist()):
            if not done[i]:
                outs[i].append(t)
                done[i] = finished(outs[i])
        if all(done):
            break
        x = nxt[:, None]
    return outs

"""The KV cache: every layer's keys and values, preallocated at exactly the size the decode needs.

    bytes = 2 (K and V) * n_layers * batch * tokens * n_kv_heads * head_dim * dtype bytes

so grouped-query and multi-query attention shrink it by n_heads / n_kv_heads. One ``[batch, n_kv_heads,
tokens, head_dim]`` tensor per layer for K and one for V, allocated once (``tokens`` = the longest prompt +
``max_new_tokens``); nothing grows during decoding.

Ragged batches are left-padded: row ``b`` has ``pad[b]`` unused slots before its prompt, so every row's newest
token sits in the same slot. Slot ``s`` of row ``b`` holds absolute position ``s - pad[b]``: RoPE is applied at
that position, and a query at slot ``t`` attends to slots ``pad[b] <= s <= t`` only. A row therefore computes
exactly what it would compute alone (``tests/unit/test_generation.py`` checks tokens against one-by-one).

Per forward, the decode loop calls ``begin(n_tokens, cos, sin)`` (the slots, positions and mask of this step,
shared by every layer), runs the model with ``kv_cache=cache`` (``DecoderStack.forward`` hands each layer its
``layer(name)``), then ``commit()``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from lmforge.config.model import ModelConfig
from lmforge.model.gpt import apply_rope, kv_heads


def kv_cache_bytes(cfg: ModelConfig, batch: int, tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """The formula: 2 * layers * batch * tokens * kv_heads * head_dim * bytes per element."""
    head_dim = cfg.d_model // cfg.n_heads
    return 2 * cfg.n_layers * batch * tokens * kv_heads(cfg) * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """K/V of every layer of ``cfg`` for ``batch`` rows of ``tokens`` slots (``pad[b]`` left-padding slots in
    row ``b``). ``device="meta"`` allocates nothing (sizes of big presets)."""

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        tokens: int,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device | str] = None,
        pad: Optional[Sequence[int]] = None,
        layers: Optional[Sequence[str]] = None,
    ):
        head_dim = cfg.d_model // cfg.n_heads
        names = [str(i) for i in range(cfg.n_layers)] if layers is None else list(layers)
        shape = (batch, kv_heads(cfg), tokens, head_dim)
        self.keys: Dict[str, torch.Tensor] = {n: torch.zeros(shape, dtype=dtype, device=device) for n in names}
        self.values: Dict[str, torch.Tensor] = {n: torch.zeros(shape, dtype=dtype, device=device) for n in names}
        self.batch, self.tokens = batch, tokens
        pad = [0] * batch if pad is None else list(pad)
        if len(pad) != batch or min(pad) < 0 or max(pad) >= tokens:
            raise ValueError(f"pad {pad}: one count per row, each in [0, {tokens})")
        self.pad = torch.tensor(pad, dtype=torch.long, device=device)
        self.length = 0  # slots filled so far (the same for every row)
        self._step: Optional[tuple] = None

    def nbytes(self) -> int:
        """Bytes of the allocated K and V tensors (what ``kv_cache_bytes`` predicts)."""
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[batch, end - start] absolute positions of slots start..end-1 (0 on padding slots)."""
        slots = torch.arange(start, end, device=self.pad.device)
        return (slots[None, :] - self.pad[:, None]).clamp_min(0)

    def begin(self, n_tokens: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Prepare a forward over the next ``n_tokens`` slots: RoPE rows at each row's positions, the mask."""
        start, end = self.length, self.length + n_tokens
        if end > self.tokens:
            raise ValueError(f"KV cache full: {end} slots needed, {self.tokens} allocated")
        pos = self.positions(start, end)
        if int(pos.max()) >= cos.shape[0]:
            raise ValueError(f"position {int(pos.max())} is beyond the RoPE tables ({cos.shape[0]} = model.seq_len)")
        flat = pos.flatten()
        keys = torch.arange(end, device=self.pad.device)
        queries = torch.arange(start, end, device=self.pad.device)
        causal = keys[None, :] <= queries[:, None]  # [T, end]
        in_row = keys[None, None, :] >= self.pad[:, None, None]  # [B, 1, end]
        # A padding slot's query attends to itself (a finite, unused result); real slots never see padding.
        mask = causal[None] & (in_row | (keys[None, None, :] == queries[None, :, None]))
        self._step = (start, end, cos[flat], sin[flat], mask[:, None])  # mask [B, 1, T, end]

    def commit(self) -> None:
        """The step's slots now hold K/V: the next ``begin`` starts after them."""
        self.length, self._step = self._step[1], None

    def layer(self, name: str) -> "LayerCache":
        return LayerCache(self, name)


class LayerCache:
    """What one ``Attention.forward`` sees: its layer's K/V buffers and the current step."""

    def __init__(self, cache: KVCache, name: str):
        self.cache, self.name = cache, name

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int, scale: Optional[float] = None
    ) -> torch.Tensor:
        """q: [B, T, H, D], k/v: [B, T, Hkv, D] of the new tokens (before RoPE) -> attention output [B, T, H*D].
        ``scale``: the softmax scale (None = 1/sqrt(D))."""
        start, end, cos, sin, mask = self.cache._step
        bsz, seqlen, _, head_dim = q.shape
        # apply_rope takes one [T, D] table for every row: rows of the batch laid end to end, one table row each.
        q = apply_rope(q.reshape(1, bsz * seqlen, -1, head_dim), cos, sin).view(bsz, seqlen, -1, head_dim)
        k = apply_rope(k.reshape(1, bsz * seqlen, -1, head_dim), cos, sin).view(bsz, seqlen, -1, head_dim)
        keys, values = self.cache.keys[self.name], self.cache.values[self.name]
        keys[:, :, start:end] = k.transpose(1, 2)
        values[:, :, start:end] = v.transpose(1, 2)
        k_all, v_all = keys[:, :, :end], values[:, :, :end]
        if n_rep > 1:
            k_all = k_all.repeat_interleave(n_rep, dim=1)
            v_all = v_all.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(bsz, seqlen, -1)

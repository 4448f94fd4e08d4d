"""Next-token cross-entropy that never materialises an fp32 copy of the whole logits tensor.

``F.cross_entropy(logits.float(), targets)`` on ``[N, V]`` bf16 logits makes an fp32 copy (4 bytes a
logit), keeps fp32 log-probabilities for backward (4 more), and its backward builds a dense fp32 gradient of
the log-probabilities and one of the logits before casting to bf16. ``chunked_cross_entropy`` is one
autograd Function instead:

- forward, ``CHUNK_ELEMENTS`` logits at a time: the chunk's fp32 log-softmax (torch's fused kernel) and
  the target's log-probability; the loss is ``-mean(log p[target])`` over the counted rows;
- backward recomputes the softmax chunk by chunk, subtracts 1 at the target, scales by ``grad / count``
  and writes the gradient in the logits' own dtype.

It keeps for backward only the logits the model produced (their dtype), the targets and the count. The
mathematics is F.cross_entropy's (mean over targets != ``ignore_index``; all ignored gives NaN, as torch):
equal within fp32 rounding (``tests/unit/test_chunked_loss.py``).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default (data.loss_after_eod=mask writes it)
CHUNK_ELEMENTS = 1 << 21  # logits upcast at a time: 8 MiB of fp32 scratch


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n, vocab = logits.shape
        counted = targets != IGNORE_INDEX
        safe = torch.where(counted, targets, 0)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        step = rows_per_chunk(vocab)
        for s in range(0, n, step):
            x = logits[s : s + step]
            target = safe[s : s + step, None]
            logp = torch.log_softmax(x, dim=-1, dtype=torch.float32)  # torch's fused kernel, chunk-sized output
            picked = logp.gather(1, target).squeeze(1)
            total -= torch.where(counted[s : s + step], picked, 0.0).sum()
        count = counted.sum()
        ctx.save_for_backward(logits, targets, count)  # nothing new but one scalar: the rest is recomputed
        return total / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, targets, count = ctx.saved_tensors
        n, vocab = logits.shape
        counted = targets != IGNORE_INDEX
        safe = torch.where(counted, targets, 0)
        grad = torch.empty_like(logits)
        weight = torch.where(counted, grad_out.float() / count, 0.0)  # per row: d loss / d row's loss
        step = rows_per_chunk(vocab)
        for s in range(0, n, step):
            rows = slice(s, s + step)
            p = torch.softmax(logits[rows], dim=-1, dtype=torch.float32)  # fused kernel, chunk-sized fp32
            p.scatter_add_(1, safe[rows, None], torch.full_like(weight[rows, None], -1.0))  # softmax - onehot
            torch.mul(p, weight[rows, None], out=grad[rows])  # rounded once into the logits' dtype
        return grad, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[N, V]`` logits (any float dtype) against ``[N]`` targets, in fp32."""
    return ChunkedCrossEntropy.apply(logits, targets)

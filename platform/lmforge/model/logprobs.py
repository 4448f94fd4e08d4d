"""Per-token log-likelihoods of the targets (what downstream evaluation scores), from a [B, T, V] logits tensor."""

from __future__ import annotations

import torch


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[2, B, T]`` fp32: row 0 the log-probability of each target token, row 1 1.0 where the target is the
    argmax (greedy) token. One tensor, so a pipeline's last stage can broadcast it in one call."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    greedy = (logits.argmax(dim=-1) == targets).float()
    return torch.stack([logp, greedy])

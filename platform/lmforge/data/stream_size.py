"""The size of a run's training stream: N, the samples megatron-core's index is built for (fixed at the first
launch, then read back from every checkpoint; see :mod:`lmforge.data.mixture`), and the samples the run needs."""

from __future__ import annotations

import math
from typing import Optional, Tuple

from lmforge.config.batch_ramp import run_samples
from lmforge.config.train import TrainConfig


def stream_sizes(
    train: TrainConfig, tokens_per_step: int, global_batch: int, seq_len: int, *, prior_state: Optional[dict] = None
) -> Tuple[int, int]:
    """(N, samples this run needs): N from the checkpoint when resuming, else from the planned tokens. Under a
    batch ramp the run's last step is whole, so it may need up to a batch more (config/batch_ramp.py)."""
    if prior_state and prior_state.get("num_train_samples"):
        n = int(prior_state["num_train_samples"])
    else:
        planned = train.planned_tokens or train.max_steps * tokens_per_step
        n = max(1, math.ceil(planned / seq_len))
    return n, max(n, train.max_steps * global_batch, run_samples(train))

"""Schema of the ``eval`` config group: downstream tasks run in the training loop (``lmforge.evaluation``).

They run on the validation schedule (``train.eval_every``, one schedule for every evaluation), on the training
mesh, and are logged as ``eval/<task>/acc``, ``eval/<task>/acc_norm`` next to ``val/<source>/{loss,bpb}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class EvalConfig:
    tasks: List[str] = field(default_factory=list)
    """Task files in lm-evaluation-harness's YAML format (local JSONL data), or the names of shipped tasks
    (lmforge/evaluation/tasks/<name>.yaml: austen_next_sentence, austen_word_order, stdlib_next_line); empty =
    none."""
    batch_size: int = 16
    """Sequences per forward (every data-parallel rank runs its share of the batches)."""
    limit: int = 0
    """Documents per task (the first N of its test split); 0 = all."""

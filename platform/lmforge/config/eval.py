"""Schema of the ``eval`` config group: downstream tasks run in the training loop (``lmforge.evaluation``).

They run on the validation schedule (``train.eval_every``, one schedule for every evaluation), on the training
mesh, and are logged as ``eval/<task>/acc``, ``eval/<task>/acc_norm`` next to ``val/<source>/{loss,bpb}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class EvalConfig:
    # Task files in lm-evaluation-harness's YAML format (local JSONL data), or the name of a shipped task
    # (lmforge/evaluation/tasks/<name>.yaml: austen_next_sentence, austen_word_order, stdlib_next_line). Empty: none.
    tasks: List[str] = field(default_factory=list)
    # Sequences per forward (every data-parallel rank runs its share of the batches).
    batch_size: int = 16
    # Documents per task (the first N of its test split); 0 = all.
    limit: int = 0

"""Schema of the ``train`` config group (``conf/train/*.yaml``): the loop, batch and precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional


@dataclass
class TrainConfig:
    name: str = "default"
    max_steps: int = 300
    # Sequences per micro batch on one data-parallel rank.
    micro_batch_size: int = 8
    # Sequences per optimizer step across all data-parallel ranks.
    global_batch_size: int = 8
    # None: derived as global / (micro * dp). If set it must agree (checked).
    grad_accum: Optional[int] = None
    # fp32 | bf16-mixed (bf16 autocast, fp32 master weights) | bf16 (pure bf16 params) | auto
    # auto = bf16-mixed on CUDA, fp32 on CPU.
    precision: Annotated[str, Literal["auto", "fp32", "bf16-mixed", "bf16"]] = "auto"
    device: Annotated[str, Literal["auto", "cpu", "cuda"]] = "auto"
    # What the C allocator does with freed memory (runtime/host_memory.py): retain (glibc keeps it: a CPU step
    # reuses its pages instead of faulting in new ones) | system (malloc as it is) | auto (retain on CPU).
    host_malloc: Annotated[str, Literal["auto", "retain", "system"]] = "auto"
    seed: int = 1234
    # Intra-op threads per process; 0 = physical cores / local ranks, so any launch computes identically.
    threads: int = 0
    deterministic: bool = False
    eval_every: int = 100
    eval_batches: int = 8
    # auto: newest complete checkpoint in the run directory, else start fresh | none | <checkpoint path>
    resume: str = "auto"
    # Start from the model weights of this checkpoint (run dir or step dir, any layout; e.g. one written by
    # `lmforge import hf`) with a fresh optimizer and data position. Ignored when resuming a checkpoint.
    init_from: Optional[str] = None
    # Tokens planned for the whole run; 0 = max_steps * global batch * seq_len. Fixes the data index size.
    planned_tokens: int = 0
    # Stop (checkpoint, exit 0, no DONE marker) once this step is done, without changing the LR schedule or the
    # data index, which follow max_steps; a later launch resumes. For time-sliced jobs and resume tests. 0: off.
    stop_at_step: int = 0

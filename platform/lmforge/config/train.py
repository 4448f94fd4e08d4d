"""Schema of the ``train`` config group (``conf/train/*.yaml``): the loop, batch and precision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal, Optional

from lmforge.config.ranges import NonNegativeInt, PositiveInt, Range

PositiveFloat = Annotated[float, Range(0, low_open=True, fix="set a value > 0")]


@dataclass
class Float8Config:
    """``train.fp8``: float8 training of the linear layers through torchao (parallel/float8.py); read only with
    ``train.precision=fp8``."""

    recipe: Annotated[str, Literal["tensorwise", "rowwise"]] = "tensorwise"
    """torchao's scaling recipe: tensorwise (one scale per tensor; allows the float8 FSDP all-gather) or rowwise
    (one scale per row of each GEMM operand, e4m3 gradients too: more accurate, slower)."""
    filter_fqns: List[str] = field(default_factory=list)
    """Linears whose module name contains one of these strings stay in bf16 (the output head and the MoE router
    always do)."""
    shape_filter: bool = True
    """Keep small linears in bf16 by torchao's per-recipe size thresholds (measured on H100: below them float8 is
    slower); false converts every linear whose dims are multiples of 16 (small models, tests)."""
    enable_fsdp_float8_all_gather: bool = False
    """FSDP2 all-gathers the converted weights in float8 (half the bf16 bytes), their scales precomputed in one
    all-reduce after each optimizer step; tensorwise recipe and FSDP (dp_shard > 1 or cp > 1) only."""
    check_every: NonNegativeInt = 0
    """Every N optimizer steps: the loss of a fixed batch under float8 against a bf16 forward of the same weights,
    logged as fp8/loss_gap; 0 = off."""
    check_tolerance: PositiveFloat = 0.05
    """The |fp8 - bf16| loss gap on the check's batch beyond which a warning is printed."""


@dataclass
class BatchSizeScheduleConfig:
    """``train.batch_size_schedule``: a ramp of the global batch by samples seen (Megatron's ``--rampup-batch-size
    <start> <increment> <ramp samples>``; GPT-3's linear batch warmup). Read by config/batch_ramp.py."""

    start: NonNegativeInt = 0
    """Global batch (sequences) of the first steps; 0 = no ramp (every step is train.global_batch_size)."""
    increment: NonNegativeInt = 0
    """Sequences added per stage until train.global_batch_size; a multiple of micro_batch_size x data-parallel
    size, as start is, and dividing global_batch_size - start."""
    ramp_samples: NonNegativeInt = 0
    """Samples (sequences) over which the batch grows in equal stages from start to train.global_batch_size; the
    stage of a step is floor(consumed_samples x stages / ramp_samples)."""


@dataclass
class SeqLenScheduleConfig:
    """``train.seq_len_schedule``: sequence-length warmup; early steps split every model.seq_len sample into 2^k
    pieces of start x 2^i tokens (the sample stream and the tokens per step are unchanged). Read by
    config/seq_len_warmup.py."""

    start: NonNegativeInt = 0
    """Sequence length of the first steps: model.seq_len / 2^k; 0 = off (every step trains full-length samples)."""
    warmup_samples: NonNegativeInt = 0
    """Samples over which the length doubles in equal stages from start to model.seq_len; the stage of a step is
    floor(consumed_samples x k / warmup_samples)."""


@dataclass
class TrainConfig:
    name: str = "default"
    """The preset's name (a conf/train file name)."""
    max_steps: PositiveInt = 1000
    """Optimizer steps of the run (the LR schedule and the data index follow it)."""
    micro_batch_size: PositiveInt = 8
    """Sequences per micro batch on one data-parallel rank."""
    global_batch_size: PositiveInt = 8
    """Sequences per optimizer step across all data-parallel ranks."""
    grad_accum: Optional[int] = None
    """Micro batches per step; null = global / (micro * dp). If set it must agree (checked)."""
    precision: Annotated[str, Literal["auto", "fp32", "bf16-mixed", "bf16", "fp8"]] = "auto"
    """fp32, bf16-mixed (fp32 parameters and optimizer state, bf16 autocast matmuls, a bf16 residual stream
    unless fp32_residual), bf16 (pure bf16 parameters), fp8 (bf16-mixed with the linears' GEMMs in float8,
    train.fp8; native engine) or auto (bf16-mixed on CUDA, fp32 on CPU); every engine reads this one key."""
    fp32_residual: bool = False
    """Under bf16-mixed on the native engine, keep the residual stream (the embedding output, every block's input
    and output, the norms' inputs) in fp32 instead of bf16. Parameters, optimizer state and the loss are fp32
    either way. Refused where the residual stream is bf16 regardless: precision=bf16, the deepspeed engine in
    bf16, FSDP with parallelism.param_dtype=bf16."""
    device: Annotated[str, Literal["auto", "cpu", "cuda"]] = "auto"
    """Where the run trains; auto = CUDA when torch sees a GPU, else the CPU."""
    host_malloc: Annotated[str, Literal["auto", "retain", "system"]] = "auto"
    """What the C allocator does with freed memory (runtime/host_memory.py): retain (glibc keeps it, so a CPU step
    reuses its pages instead of faulting in new ones), system (malloc as it is), auto (retain on CPU)."""
    seed: int = 1234
    """Random seed of the run (model initialisation and every random stream the loop uses)."""
    threads: NonNegativeInt = 0
    """Intra-op threads per process; 0 = physical cores / local ranks, so any launch computes identically."""
    deterministic: bool = False
    """Use deterministic algorithms only (torch.use_deterministic_algorithms): reproducible, sometimes slower."""
    eval_every: NonNegativeInt = 200
    """Steps between evaluations (held-out loss and eval tasks); 0 = never."""
    eval_batches: PositiveInt = 8
    """Batches per held-out loss evaluation."""
    resume: str = "auto"
    """auto (the newest complete checkpoint in the run directory, else a fresh start), none, or a checkpoint
    path (one outside the run is where it starts: once the run has a checkpoint of its own, it continues from
    that)."""
    init_from: Optional[str] = None
    """Start from the model weights of this checkpoint (run dir or step dir, any layout; e.g. one written by
    ``lmforge import hf``) with a fresh optimizer and data position. Ignored when resuming a checkpoint."""
    planned_tokens: NonNegativeInt = 0
    """Tokens planned for the whole run; 0 = max_steps * global batch * seq_len. Fixes the data index size."""
    stop_at_step: int = 0
    """Stop (checkpoint, exit 0, no DONE marker) once this step is done, without changing the LR schedule or the
    data index, which follow max_steps; a later launch resumes. For time-sliced jobs and resume tests. 0 = off."""
    batch_size_schedule: BatchSizeScheduleConfig = field(default_factory=BatchSizeScheduleConfig)
    """The global batch's ramp by samples seen (off by default). With it on, train.max_steps and the LR schedule's
    step keys count full-batch steps (global_batch_size samples each), so the run's tokens and its LR per token
    are those of the same run without the ramp; checkpoint, eval, logging and stop_at_step count optimizer steps."""
    seq_len_schedule: SeqLenScheduleConfig = field(default_factory=SeqLenScheduleConfig)
    """Sequence-length warmup by samples seen (off by default): each sample cut into 2^k pieces early on."""
    fp8: Float8Config = field(default_factory=Float8Config)
    """Float8 training (``train.precision=fp8``): recipe, which linears, FSDP float8 all-gather, numerics check."""

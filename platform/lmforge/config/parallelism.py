"""Schema of the ``parallelism`` config group (``conf/parallelism/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal

from lmforge.config.ranges import NonNegativeInt, PositiveInt

PipelineSchedule = Annotated[str, Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]]
# The parts of a block activation_checkpointing=modules can recompute (parallel/activation_checkpoint.py).
RECOMPUTE_MODULES = ("attention_core", "mlp", "norms")
DEFAULT_RECOMPUTE_MODULES = ["attention_core"]
# Schedules that split each backward into an input-gradient and a later weight-gradient part.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")


@dataclass
class ParallelismConfig:
    """The layout: world size = dp_replicate * dp_shard * cp * tp * pp (``ep`` is borrowed from dp_shard)."""

    name: str = "single"
    """The preset's name (a conf/parallelism file name)."""
    engine: Annotated[str, Literal["native", "deepspeed"]] = "native"
    """Training engine: native (PyTorch DDP/FSDP2/TP/PP) or deepspeed (ZeRO over dp_replicate)."""
    dp_replicate: PositiveInt = 1
    """DDP-style replication degree (the HSDP outer dim when dp_shard > 1)."""
    dp_shard: PositiveInt = 1
    """FSDP2 sharding degree."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3-like); false keeps them to backward (ZeRO-2-like), and
    with fsdp_grad_sync=last_microbatch from the step's first forward to its last backward (one all-gather per
    step: the distributed_optimizer preset)."""
    cp: PositiveInt = 1
    """Context parallelism (parallel/context_parallel.py): each sequence split over cp ranks in the load-balanced
    causal layout (2*cp chunks, rank r holds chunks r and 2*cp-1-r); cp ranks hold weight replicas, FSDP shards
    over dp_shard x cp."""
    cp_kv_exchange: Annotated[str, Literal["ring", "allgather"]] = "ring"
    """How cp ranks exchange K/V: a ring of point-to-point sends overlapped with compute, or one all-gather."""
    ep: PositiveInt = 1
    """Expert parallelism (parallel/expert_parallel.py): the routed experts of every MoE layer split E/ep per
    rank, tokens dispatched by all-to-all. Borrowed from dp_shard (ep divides dp_shard, no mesh dim of its own):
    each rank's experts are FSDP-sharded over the dp_shard / ep ranks outside its ep group."""
    tp: PositiveInt = 1
    """Tensor parallelism degree (Megatron column/row split of attention and MLP, vocab-parallel embedding)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and the residual stream sharded along the sequence."""
    pp: PositiveInt = 1
    """Pipeline parallelism degree (torch.distributed.pipelining)."""
    pp_schedule: PipelineSchedule = "1F1B"
    """Pipeline schedule."""
    pp_virtual_stages: PositiveInt = 1
    """Model chunks per pipeline rank (> 1 for the interleaved and zero-bubble schedules)."""
    pp_microbatches: NonNegativeInt = 0
    """Pipeline microbatches per step; 0 = as many as the gradient-accumulation steps."""
    activation_checkpointing: Annotated[str, Literal["none", "full", "selective", "modules"]] = "none"
    """Recompute activations in backward: none, every block (full), the cheap ops (selective), or the parts of
    each block that recompute_modules names (modules)."""
    recompute_modules: List[str] = field(default_factory=lambda: list(DEFAULT_RECOMPUTE_MODULES))
    """With activation_checkpointing=modules, the parts of a block recomputed in backward (Megatron's
    --recompute-modules): attention_core (the attention kernel: keeps its q, k, v, drops its output and
    log-sum-exp), mlp (the feed-forward, dense or MoE: keeps its input only), norms (both norms: keep their
    inputs only)."""
    recompute_layers: NonNegativeInt = 0
    """Checkpoint only the first k blocks of each pipeline stage (Megatron's --recompute-method block
    --recompute-num-layers k), under full, selective or modules; 0 = every block."""
    compile: bool = False
    """torch.compile each block (native engine only)."""
    param_dtype: Annotated[str, Literal["fp32", "bf16"]] = "fp32"
    """FSDP mixed precision: the dtype parameters are gathered and computed in."""
    reduce_dtype: Annotated[str, Literal["fp32", "bf16"]] = "fp32"
    """FSDP mixed precision: the dtype gradients are reduced in."""
    overlap_grad_reduce: bool = True
    """Overlap gradient reduction with backward (DDP bucketing / FSDP prefetch)."""
    fsdp_grad_sync: Annotated[str, Literal["auto", "every_microbatch", "last_microbatch"]] = "auto"
    """FSDP2 gradient reduction under gradient accumulation: every_microbatch (reduce-scatter after each micro
    batch's backward: least memory), last_microbatch (unsharded gradients kept until the last micro batch, then
    one reduce-scatter: 1/grad_accum of the communication), auto (every_microbatch for FSDP without pipelining,
    last_microbatch otherwise)."""
    ddp_bucket_cap_mb: int = 25
    """DDP gradient bucket size in MiB."""
    zero_stage: int = 0
    """DeepSpeed engine only: ZeRO stage 0, 1, 2 or 3."""
    offload_optimizer: Annotated[str, Literal["none", "cpu"]] = "none"
    """DeepSpeed engine only: keep the optimizer state and step on the CPU (ZeRO-Offload)."""
    offload_params: Annotated[str, Literal["none", "cpu"]] = "none"
    """DeepSpeed engine only (ZeRO-3): keep the parameter partitions in host memory."""
    deepspeed_config: str = ""
    """DeepSpeed engine only: a user JSON merged over the generated config (conflicts are errors)."""


def fsdp_grad_sync_mode(p: ParallelismConfig) -> str:
    """``every_microbatch`` or ``last_microbatch``: when data-parallel gradients are reduced under accumulation.

    Only FSDP2 without pipelining can reduce on every micro batch; DDP (``no_sync``), the manual all-reduce and
    the pipeline schedules (``torch.distributed.pipelining`` turns FSDP gradient sync off until the last
    microbatch) always reduce once per step. ``config/validate.py`` refuses ``every_microbatch`` elsewhere.
    """
    if p.fsdp_grad_sync != "auto":
        return p.fsdp_grad_sync
    return "every_microbatch" if p.dp_shard * p.cp > 1 and p.pp == 1 else "last_microbatch"

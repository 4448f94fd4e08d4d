"""Schema of the ``parallelism`` config group (``conf/parallelism/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, List, Literal, Optional

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
    loss_parallel: bool = True
    """With tp > 1: the cross-entropy computed on the vocab-sharded logits (two all-reduces over tp: the [tokens] row
    max, then the [2, tokens] exp sums and target logits), never gathering them (Megatron's vocab-parallel
    cross-entropy, torchtitan's loss parallel); false gathers the full logits on every tp rank first."""
    pp: PositiveInt = 1
    """Pipeline parallelism degree (torch.distributed.pipelining)."""
    pp_schedule: PipelineSchedule = "1F1B"
    """Pipeline schedule."""
    pp_virtual_stages: PositiveInt = 1
    """Model chunks per pipeline rank (> 1 for the interleaved and zero-bubble schedules)."""
    pp_layers: Optional[List[int]] = None
    """Transformer blocks per pipeline chunk, in chunk order (chunk c is stage c of the schedule: the first holds
    the embedding too, the last the final norm and the output head); pp * pp_virtual_stages counts, each >= 1,
    summing to model.n_layers. null = n_layers / (pp * pp_virtual_stages) each, refused (with a suggested map)
    when that does not divide. E.g. 126 layers over pp=16: [7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]."""
    pp_microbatches: NonNegativeInt = 0
    """Pipeline microbatches per step; 0 = as many as the gradient-accumulation steps."""
    activation_checkpointing: Annotated[str, Literal["none", "full", "selective", "modules"]] = "none"
    """Recompute activations in backward: none, every block (full), the cheap ops (selective), or the parts of
    each block that recompute_modules names (modules)."""
    selective_matmuls: Annotated[str, Literal["all", "alternate"]] = "all"
    """With activation_checkpointing=selective, which matmul outputs of a block are kept for backward: all, or
    alternate (the 1st, 3rd, 5th... matmul of each block kept, the others recomputed: torchtitan's op-level SAC
    policy; wk, wo and w3 recomputed in a SwiGLU block, wk, wo and w2 in a GELU one)."""
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


def pipeline_chunks(p: ParallelismConfig) -> int:
    """Model chunks (pipeline stages) of the layout: ``pp * pp_virtual_stages``."""
    return p.pp * p.pp_virtual_stages


def chunk_layers(p: ParallelismConfig, n_layers: int) -> List[int]:
    """Blocks of each pipeline chunk, in chunk order: ``pp_layers`` when set, else the even split (ceil-sized
    chunks, the last ones shorter, for a layout ``config/validate.py`` has not checked; it refuses that case)."""
    if p.pp_layers is not None:
        return [int(n) for n in p.pp_layers]
    chunks = pipeline_chunks(p)
    per = -(-n_layers // chunks)
    return [max(0, min(per, n_layers - c * per)) for c in range(chunks)]


def chunk_of_layer(p: ParallelismConfig, n_layers: int, layer: int) -> int:
    """The pipeline chunk holding block ``layer`` (consecutive blocks per chunk, ``chunk_layers`` of them)."""
    end = 0
    for chunk, count in enumerate(chunk_layers(p, n_layers)):
        end += count
        if layer < end:
            return chunk
    raise ValueError(f"layer {layer} is outside the {n_layers} layers of the pipeline split")


def suggested_pp_layers(n_layers: int, chunks: int) -> List[int]:
    """A balanced stage map: ``ceil(n_layers / chunks)`` blocks per chunk, one fewer on as many chunks as needed,
    taken from the ends inwards (first, last, second, second to last, ...): the chunks that also hold the
    embedding and the output head get the fewer blocks. 126 over 16: ``[7, 8 x 14, 7]``."""
    per = -(-n_layers // chunks)
    counts = [per] * chunks
    ends = [i // 2 if i % 2 == 0 else chunks - 1 - i // 2 for i in range(chunks)]
    for chunk in ends[: per * chunks - n_layers]:
        counts[chunk] -= 1
    return counts


def pp_layers_override(counts: List[int]) -> str:
    """``parallelism.pp_layers=[...]`` as a command-line override (no spaces: one shell word)."""
    return f"parallelism.pp_layers=[{','.join(str(n) for n in counts)}]"

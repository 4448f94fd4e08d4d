"""Schema of the ``parallelism`` config group (``conf/parallelism/*.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

PipelineSchedule = Annotated[str, Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]]
# Schedules that split each backward into an input-gradient and a later weight-gradient part.
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")


@dataclass
class ParallelismConfig:
    name: str = "single"
    engine: Annotated[str, Literal["native", "deepspeed"]] = "native"
    # Mesh dims. world size = dp_replicate * dp_shard * cp * tp * pp.
    dp_replicate: int = 1  # DDP-style replication (HSDP outer dim when dp_shard > 1)
    dp_shard: int = 1  # FSDP2 sharding degree
    reshard_after_forward: bool = True  # True: ZeRO-3-like, False: ZeRO-2-like
    # Context parallelism (parallel/context_parallel.py): each sequence split over cp ranks in the load-balanced
    # causal layout (2*cp chunks, rank r holds chunks r and 2*cp-1-r); K/V exchanged by a ring of point-to-point
    # sends overlapped with compute, or by one all-gather. cp ranks hold weight replicas: FSDP shards over dp_shard x cp.
    cp: int = 1
    cp_kv_exchange: Annotated[str, Literal["ring", "allgather"]] = "ring"
    # Expert parallelism (parallel/expert_parallel.py): the routed experts of every MoE layer split E/ep per rank,
    # tokens dispatched to their experts' ranks by all-to-all. Borrowed from dp_shard (ep divides dp_shard, not a
    # mesh dim of its own in the world size): the dense part stays sharded over all dp_shard ranks, each rank's
    # experts are FSDP-sharded over the dp_shard / ep ranks outside its ep group (as torchtitan).
    ep: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    pp: int = 1
    pp_schedule: PipelineSchedule = "1F1B"
    pp_virtual_stages: int = 1  # model chunks per pipeline rank (>1 for interleaved schedules)
    pp_microbatches: int = 0  # 0 means: as many as the gradient-accumulation steps
    activation_checkpointing: Annotated[str, Literal["none", "full", "selective"]] = "none"
    compile: bool = False
    # FSDP mixed precision: parameter dtype for compute and reduce dtype for gradients (fp32 | bf16).
    param_dtype: Annotated[str, Literal["fp32", "bf16"]] = "fp32"
    reduce_dtype: Annotated[str, Literal["fp32", "bf16"]] = "fp32"
    # Overlap gradient reduction with backward (DDP bucketing / FSDP prefetch).
    overlap_grad_reduce: bool = True
    # FSDP2 gradient reduction under gradient accumulation (see fsdp_grad_sync_mode):
    # every_microbatch: reduce-scatter after each micro batch's backward (least memory);
    # last_microbatch: keep unsharded gradients until the last micro batch, then one reduce-scatter
    # (1/grad_accum of the communication, unsharded gradients of every block held between micro batches);
    # auto: every_microbatch for FSDP without pipelining, last_microbatch otherwise.
    fsdp_grad_sync: Annotated[str, Literal["auto", "every_microbatch", "last_microbatch"]] = "auto"
    ddp_bucket_cap_mb: int = 25
    # DeepSpeed engine only.
    zero_stage: int = 0
    offload_optimizer: Annotated[str, Literal["none", "cpu"]] = "none"
    offload_params: Annotated[str, Literal["none", "cpu"]] = "none"
    deepspeed_config: str = ""  # optional user JSON merged over the generated config (conflicts are errors)


def fsdp_grad_sync_mode(p: ParallelismConfig) -> str:
    """``every_microbatch`` or ``last_microbatch``: when data-parallel gradients are reduced under accumulation.

    Only FSDP2 without pipelining can reduce on every micro batch; DDP (``no_sync``), the manual all-reduce and
    the pipeline schedules (``torch.distributed.pipelining`` turns FSDP gradient sync off until the last
    microbatch) always reduce once per step. ``config/validate.py`` refuses ``every_microbatch`` elsewhere.
    """
    if p.fsdp_grad_sync != "auto":
        return p.fsdp_grad_sync
    return "every_microbatch" if p.dp_shard * p.cp > 1 and p.pp == 1 else "last_microbatch"

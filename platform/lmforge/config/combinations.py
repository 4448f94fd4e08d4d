"""Feature combinations lmforge refuses, in one table: each row the combination, the key it names, why, the fix.

``check_combinations`` walks ``REFUSED`` in order and raises the first row that applies; it runs inside
``validate.check_parallel_layout`` (so ``validate()``, ``lmforge plan``'s candidates and ``lmforge launch`` see
the same refusals). docs/configuration.md lists the table (``docs_rows()``; tests/unit/test_config_combinations.py
checks the page against it). Arithmetic checks (divisibility, world size) stay in ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

from lmforge.config.batch_ramp import run_steps
from lmforge.config.errors import ConfigError
from lmforge.config.parallelism import DEFAULT_RECOMPUTE_MODULES, RECOMPUTE_MODULES, ZERO_BUBBLE_SCHEDULES
from lmforge.config.schema import RootConfig

Test = Callable[[RootConfig], bool]
Reason = Callable[[RootConfig], str]


@dataclass(frozen=True)
class Refused:
    """One refused combination: ``applies(cfg)`` -> ConfigError(key, reason(cfg), fix)."""

    when: str  # the combination as the docs list it
    key: str
    applies: Test
    reason: Reason
    fix: str


def _zero_bubble(c: RootConfig) -> bool:
    return c.parallelism.pp > 1 and c.parallelism.pp_schedule in ZERO_BUBBLE_SCHEDULES


def _every_microbatch_why(c: RootConfig) -> str:
    why = (
        "pipeline schedules reduce FSDP gradients once per step, after the last microbatch"
        if c.parallelism.pp > 1
        else "only FSDP (dp_shard > 1) can reduce per micro batch; DDP and the all-reduce sync once per step"
    )
    return f"every_microbatch is not possible here: {why}"


def _recompute_modules_unknown(c: RootConfig) -> List[str]:
    return [m for m in c.parallelism.recompute_modules if m not in RECOMPUTE_MODULES]


def _recomputes_attention_core(c: RootConfig) -> bool:
    p = c.parallelism
    return p.activation_checkpointing == "modules" and "attention_core" in p.recompute_modules


def _fp8(c: RootConfig) -> bool:
    return c.train.precision == "fp8"


def _fp8_keys_set(c: RootConfig) -> bool:
    return c.train.fp8.check_every > 0 or c.train.fp8.enable_fsdp_float8_all_gather


def _bf16_residual_anyway(c: RootConfig) -> str:
    """Why the residual stream is bf16 whatever train.fp32_residual says; "" where the flag applies."""
    p = c.parallelism
    if c.train.precision == "bf16":
        return "precision=bf16 keeps the parameters in bf16"
    if p.engine == "deepspeed" and c.train.precision != "fp32":
        return "DeepSpeed's bf16 mode (train.precision bf16-mixed or auto) holds bf16 weights"
    if (p.dp_shard > 1 or p.cp > 1) and p.param_dtype == "bf16":
        return "FSDP with parallelism.param_dtype=bf16 computes from bf16 parameters"
    return ""


REFUSED: Tuple[Refused, ...] = (
    Refused(
        "`recompute_modules` set without `activation_checkpointing=modules`",
        "parallelism.recompute_modules",
        lambda c: (
            c.parallelism.activation_checkpointing != "modules"
            and list(c.parallelism.recompute_modules) != DEFAULT_RECOMPUTE_MODULES
        ),
        lambda c: (
            f"only activation_checkpointing=modules reads it (this run: {c.parallelism.activation_checkpointing}), "
            "so it would be silently ignored"
        ),
        "set parallelism.activation_checkpointing=modules, or leave recompute_modules unset",
    ),
    Refused(
        "`recompute_modules` empty, or naming a part other than attention_core, mlp, norms",
        "parallelism.recompute_modules",
        lambda c: (
            c.parallelism.activation_checkpointing == "modules"
            and (not c.parallelism.recompute_modules or bool(_recompute_modules_unknown(c)))
        ),
        lambda c: (
            f"{', '.join(_recompute_modules_unknown(c))} is not a part of a block"
            if _recompute_modules_unknown(c)
            else "is empty: activation_checkpointing=modules would recompute nothing"
        ),
        f"name parts from {', '.join(RECOMPUTE_MODULES)} (e.g. parallelism.recompute_modules=[attention_core,mlp])",
    ),
    Refused(
        "`recompute_layers > 0` with `activation_checkpointing=none`",
        "parallelism.recompute_layers",
        lambda c: c.parallelism.recompute_layers > 0 and c.parallelism.activation_checkpointing == "none",
        lambda c: f"recompute_layers={c.parallelism.recompute_layers} picks blocks to checkpoint, but none are",
        "set parallelism.activation_checkpointing=full (or selective, modules), or recompute_layers=0",
    ),
    Refused(
        "`selective_matmuls=alternate` without `activation_checkpointing=selective`",
        "parallelism.selective_matmuls",
        lambda c: c.parallelism.selective_matmuls != "all" and c.parallelism.activation_checkpointing != "selective",
        lambda c: (
            f"only activation_checkpointing=selective reads it (this run: {c.parallelism.activation_checkpointing}), "
            "so it would be silently ignored"
        ),
        "set parallelism.activation_checkpointing=selective, or leave selective_matmuls unset",
    ),
    Refused(
        "`recompute_modules` with `attention_core` and `cp > 1` or `data.document_masking=true`",
        "parallelism.recompute_modules",
        lambda c: _recomputes_attention_core(c) and (c.parallelism.cp > 1 or c.data.document_masking),
        lambda c: (
            "recomputing the attention core would redo the context-parallel K/V exchange in backward"
            if c.parallelism.cp > 1
            else "document-masked attention runs its own kernel, which attention_core does not reach"
        ),
        "recompute mlp and norms only, or use activation_checkpointing=full",
    ),
    Refused(
        "`sequence_parallel=true` with `tp=1`",
        "parallelism.sequence_parallel",
        lambda c: c.parallelism.sequence_parallel and c.parallelism.tp == 1,
        lambda c: "needs tp > 1",
        "set parallelism.tp >= 2 or sequence_parallel=false",
    ),
    Refused(
        "`pp_virtual_stages > 1` with `pp_schedule=GPipe` or `1F1B`",
        "parallelism.pp_virtual_stages",
        lambda c: c.parallelism.pp_virtual_stages > 1 and c.parallelism.pp_schedule in ("GPipe", "1F1B"),
        lambda c: f"{c.parallelism.pp_schedule} runs one stage per rank",
        "use pp_schedule=Interleaved1F1B (or a zero-bubble schedule) for virtual stages",
    ),
    Refused(
        "`pp_schedule=ZBVZeroBubble` with `pp > 1` and `pp_virtual_stages != 2`",
        "parallelism.pp_virtual_stages",
        lambda c: (
            c.parallelism.pp_schedule == "ZBVZeroBubble"
            and c.parallelism.pp > 1
            and c.parallelism.pp_virtual_stages != 2
        ),
        lambda c: f"ZBVZeroBubble runs exactly 2 stages per rank, got {c.parallelism.pp_virtual_stages}",
        "set parallelism.pp_virtual_stages=2",
    ),
    Refused(
        "`pp > 1` with `model.tie_embeddings=true`",
        "model.tie_embeddings",
        lambda c: c.parallelism.pp > 1 and c.model.tie_embeddings,
        lambda c: "tied input/output embeddings would live on the first and the last pipeline stage",
        "set model.tie_embeddings=false for pp > 1",
    ),
    Refused(
        "`model.parametrization=mup` with `model.tie_embeddings=true`",
        "model.tie_embeddings",
        lambda c: c.model.parametrization == "mup" and c.model.tie_embeddings,
        lambda c: (
            "muP treats the embedding (lr and init independent of width) and the output head (logits times "
            "base/width, lr independent of width) as two parameters"
        ),
        "set model.tie_embeddings=false with model.parametrization=mup",
    ),
    Refused(
        "`compile=true` with a zero-bubble schedule (`pp > 1`)",
        "parallelism.compile",
        lambda c: c.parallelism.compile and _zero_bubble(c),
        lambda c: (
            f"{c.parallelism.pp_schedule} splits backward into input and weight parts, which torch.compile does "
            "not support"
        ),
        "set parallelism.compile=false or use 1F1B/Interleaved1F1B",
    ),
    Refused(
        "a zero-bubble schedule (`pp > 1`) with FSDP (`dp_shard > 1` or `cp > 1`) and `reshard_after_forward=true`",
        "parallelism.reshard_after_forward",
        lambda c: (
            _zero_bubble(c)
            and (c.parallelism.dp_shard > 1 or c.parallelism.cp > 1)
            and c.parallelism.reshard_after_forward
        ),
        lambda c: (
            f"{c.parallelism.pp_schedule} with FSDP (dp_shard={c.parallelism.dp_shard}, "
            f"cp={c.parallelism.cp}) and reshard_after_forward=true loses weight gradients (torch 2.13: the input "
            "backward takes the stage's parameters from the module, which holds the resharded ones, not "
            "the gathered ones the graph used; step-1 gradient norm 0.913 vs 1.087)"
        ),
        "set parallelism.reshard_after_forward=false (blocks stay gathered until the weight "
        "backward), or use pp_schedule=1F1B or Interleaved1F1B",
    ),
    Refused(
        "`compile=true` with `tp > 1`",
        "parallelism.compile",
        lambda c: c.parallelism.compile and c.parallelism.tp > 1,
        lambda c: (
            "torch.compile of tensor-parallel blocks fails in the first backward "
            "(torch 2.13: AttributeError in DTensor's Redistribute backward, reproduced on 2 gloo ranks; "
            "compile with ddp, fsdp and pp2 trains with losses identical to eager)"
        ),
        "set parallelism.compile=false for tp > 1",
    ),
    Refused(
        "`fsdp_grad_sync=every_microbatch` without FSDP (`dp_shard * cp = 1`) or with `pp > 1`",
        "parallelism.fsdp_grad_sync",
        lambda c: (
            c.parallelism.fsdp_grad_sync == "every_microbatch"
            and (c.parallelism.dp_shard * c.parallelism.cp == 1 or c.parallelism.pp > 1)
        ),
        _every_microbatch_why,
        "set parallelism.fsdp_grad_sync=auto (or last_microbatch)",
    ),
    Refused(
        "`engine=deepspeed` with `tp > 1`, `pp > 1` or `dp_shard > 1`",
        "parallelism.engine",
        lambda c: (
            c.parallelism.engine == "deepspeed"
            and (c.parallelism.tp > 1 or c.parallelism.pp > 1 or c.parallelism.dp_shard > 1)
        ),
        lambda c: "the deepspeed engine shards with ZeRO over dp_replicate only",
        "set tp=1, pp=1, dp_shard=1 and use dp_replicate for the data-parallel size",
    ),
    Refused(
        "`train.fp32_residual=true` with `precision=bf16`, the deepspeed engine in bf16 or FSDP `param_dtype=bf16`",
        "train.fp32_residual",
        lambda c: c.train.fp32_residual and bool(_bf16_residual_anyway(c)),
        lambda c: f"the residual stream is bf16 there: {_bf16_residual_anyway(c)}",
        "set train.fp32_residual=false, or use train.precision=bf16-mixed on the native engine with "
        "parallelism.param_dtype=fp32",
    ),
)


FLOAT8: Tuple[Refused, ...] = (
    Refused(
        "`train.fp8.check_every > 0` or `enable_fsdp_float8_all_gather=true` without `train.precision=fp8`",
        "train.fp8",
        lambda c: _fp8_keys_set(c) and not _fp8(c),
        lambda c: f"train.fp8.* applies to train.precision=fp8 only, not train.precision={c.train.precision}",
        "set train.precision=fp8, or leave train.fp8.check_every=0 and enable_fsdp_float8_all_gather=false",
    ),
    Refused(
        "`train.precision=fp8` with `engine=deepspeed`",
        "train.precision",
        lambda c: _fp8(c) and c.parallelism.engine == "deepspeed",
        lambda c: "fp8 converts linears to torchao Float8Linear, which only the native engine applies",
        "use parallelism.engine=native for fp8, or train.precision=bf16-mixed with deepspeed",
    ),
    Refused(
        "`train.fp8.enable_fsdp_float8_all_gather=true` with `train.fp8.recipe=rowwise`",
        "train.fp8.enable_fsdp_float8_all_gather",
        lambda c: _fp8(c) and c.train.fp8.enable_fsdp_float8_all_gather and c.train.fp8.recipe == "rowwise",
        lambda c: "the float8 all-gather needs one scale per weight tensor: train.fp8.recipe=tensorwise",
        "set train.fp8.recipe=tensorwise or train.fp8.enable_fsdp_float8_all_gather=false",
    ),
    Refused(
        "`train.fp8.enable_fsdp_float8_all_gather=true` without FSDP (`dp_shard * cp = 1`)",
        "train.fp8.enable_fsdp_float8_all_gather",
        lambda c: (
            _fp8(c) and c.train.fp8.enable_fsdp_float8_all_gather and c.parallelism.dp_shard * c.parallelism.cp == 1
        ),
        lambda c: "without FSDP (dp_shard=1, cp=1) no weight is all-gathered",
        "set parallelism.dp_shard > 1, or train.fp8.enable_fsdp_float8_all_gather=false",
    ),
    Refused(
        "`train.fp8.check_every > 0` with `train.fp8.enable_fsdp_float8_all_gather=true`",
        "train.fp8.check_every",
        lambda c: _fp8(c) and c.train.fp8.check_every > 0 and c.train.fp8.enable_fsdp_float8_all_gather,
        lambda c: (
            "the numerics check's bf16 forward needs bf16 weights, but the float8 all-gather delivers float8 ones"
        ),
        "set train.fp8.check_every=0, or train.fp8.enable_fsdp_float8_all_gather=false while checking",
    ),
)

SCHEDULE: Tuple[Refused, ...] = (
    Refused(
        "`decay_steps` or `decay_shape` set without `schedule=wsd`",
        "optim.schedule",
        lambda c: c.optim.schedule != "wsd" and (c.optim.decay_steps > 0 or c.optim.decay_shape != "linear"),
        lambda c: f"only the wsd schedule reads optim.decay_steps and optim.decay_shape (this run: {c.optim.schedule})",
        "set optim.schedule=wsd, or leave decay_steps and decay_shape unset",
    ),
    Refused(
        "a wsd decay longer than the run after its warmup",
        "optim.decay_steps",
        lambda c: c.optim.schedule == "wsd" and c.optim.decay_steps > c.train.max_steps - c.optim.warmup_steps,
        lambda c: (
            f"{c.optim.decay_steps} decay steps do not fit in train.max_steps={c.train.max_steps} after "
            f"{c.optim.warmup_steps} warmup steps"
        ),
        "lower optim.decay_steps or optim.warmup_steps, or raise train.max_steps",
    ),
)

CHECKPOINT: Tuple[Refused, ...] = (
    Refused(
        "`checkpoint.at_steps` with a step outside 1..`train.max_steps`, or with `checkpoint.enabled=false`",
        "checkpoint.at_steps",
        lambda c: (
            bool(c.checkpoint.at_steps)
            and (not c.checkpoint.enabled or not all(1 <= s <= run_steps(c.train) for s in c.checkpoint.at_steps))
        ),
        lambda c: (
            f"steps {list(c.checkpoint.at_steps)} would not all be saved (train.max_steps={c.train.max_steps}, "
            f"checkpoint.enabled={str(c.checkpoint.enabled).lower()})"
        ),
        "list steps in 1..train.max_steps and set checkpoint.enabled=true, or leave checkpoint.at_steps empty",
    ),
)


def _ramp(c: RootConfig) -> bool:
    return c.train.batch_size_schedule.start > 0


BATCH_RAMP: Tuple[Refused, ...] = (
    Refused(
        "`train.batch_size_schedule` with `parallelism.engine=deepspeed`",
        "train.batch_size_schedule.start",
        lambda c: _ramp(c) and c.parallelism.engine == "deepspeed",
        lambda c: "DeepSpeed's engine fixes train_batch_size and gradient_accumulation_steps when it is built",
        "use parallelism.engine=native for a batch ramp, or set train.batch_size_schedule.start=0",
    ),
    Refused(
        "`train.batch_size_schedule` with pipeline parallelism (`parallelism.pp > 1`)",
        "train.batch_size_schedule.start",
        lambda c: _ramp(c) and c.parallelism.pp > 1,
        lambda c: f"the pipeline schedule is built for a fixed number of microbatches (pp={c.parallelism.pp})",
        "set parallelism.pp=1 for a batch ramp, or train.batch_size_schedule.start=0",
    ),
    Refused(
        "`train.batch_size_schedule` with `train.grad_accum` set",
        "train.grad_accum",
        lambda c: _ramp(c) and c.train.grad_accum is not None,
        lambda c: f"under a batch ramp each step's accumulation follows its batch, not a fixed {c.train.grad_accum}",
        "leave train.grad_accum=null (derived per step: batch / (micro_batch_size x data-parallel size))",
    ),
)


def _seq_warmup(c: RootConfig) -> bool:
    return c.train.seq_len_schedule.start > 0


SEQ_LEN_WARMUP: Tuple[Refused, ...] = (
    Refused(
        "`train.seq_len_schedule` with `parallelism.engine=deepspeed` or pipeline parallelism (`parallelism.pp > 1`)",
        "train.seq_len_schedule.start",
        lambda c: _seq_warmup(c) and (c.parallelism.engine == "deepspeed" or c.parallelism.pp > 1),
        lambda c: (
            "the pipeline's stages exchange activations of one fixed sequence length"
            if c.parallelism.pp > 1
            else "the DeepSpeed engine is not verified with changing sequence lengths"
        ),
        "use parallelism.engine=native with parallelism.pp=1, or set train.seq_len_schedule.start=0",
    ),
)


def _torchft(c: RootConfig) -> bool:
    return c.fault.replica_ft == "torchft"


def _refused_in_group(c: RootConfig) -> str:
    """What of this layout a torchft replica group cannot hold ("" where nothing): data and tensor parallelism
    (dp_replicate, dp_shard, tp) keep every rank's state as local shards that rank i of each group averages and
    heals with rank i of the others; cp, pp, ep and DeepSpeed are not verified there."""
    p = c.parallelism
    dims = {k: getattr(p, k) for k in ("cp", "pp", "ep") if getattr(p, k) > 1}
    parts = [f"{k}={v}" for k, v in dims.items()] + (["engine=deepspeed"] if p.engine == "deepspeed" else [])
    return ", ".join(parts)


REPLICA_FT: Tuple[Refused, ...] = (
    Refused(
        "`fault.replica_ft=torchft` with context, pipeline or expert parallelism or DeepSpeed inside a replica group "
        "(cp, pp, ep > 1; engine=deepspeed)",
        "fault.replica_ft",
        lambda c: _torchft(c) and bool(_refused_in_group(c)),
        lambda c: (
            f"a torchft replica group holds data- and tensor-parallel ranks only (dp_replicate, dp_shard, tp); this "
            f"layout has {_refused_in_group(c)}, which replica groups are not verified with"
        ),
        "use parallelism=fsdp, ddp, tp2, tp2_sp, tp2_dp2 or single inside each group (launchers/torchft_local.sh "
        "--nproc-per-group K), or fault.replica_ft=none",
    ),
    Refused(
        "`fault.replica_id` outside 0..`fault.replica_groups`-1, or `fault.replica_min` above `fault.replica_groups`",
        "fault.replica_id",
        lambda c: (
            _torchft(c)
            and (c.fault.replica_id >= c.fault.replica_groups or c.fault.replica_min > c.fault.replica_groups)
        ),
        lambda c: (
            f"replica_id={c.fault.replica_id} and replica_min={c.fault.replica_min} must fit in "
            f"replica_groups={c.fault.replica_groups}"
        ),
        "start replicas with launchers/torchft_local.sh (it sets both), or set replica_id < replica_groups and "
        "replica_min <= replica_groups",
    ),
    Refused(
        "`fault.replica_min` at most half of `fault.replica_groups`",
        "fault.replica_min",
        lambda c: _torchft(c) and c.fault.replica_min <= c.fault.replica_groups // 2,
        lambda c: (
            f"replica_min={c.fault.replica_min} of replica_groups={c.fault.replica_groups} lets two disjoint quorums "
            "commit the same step with different weights (split brain; torchft heals only a replica behind in steps)"
        ),
        "set fault.replica_min to a majority: replica_groups // 2 + 1 (launchers/torchft_local.sh's default)",
    ),
    Refused(
        "`fault.replica_ft=torchft` with `fault.spike_factor > 0` or an MoE model",
        "fault.replica_ft",
        lambda c: _torchft(c) and (c.fault.spike_factor > 0 or c.model.moe.experts > 0),
        lambda c: (
            "the loss-spike detector's running mean and the MoE expert loads (router bias updates) are each group's "
            "own, not healed nor averaged across groups: the groups' updates would diverge"
        ),
        "set fault.spike_factor=0 (NaN/Inf skips are decided alike on every group) and use a dense model, or "
        "fault.replica_ft=none",
    ),
    Refused(
        "`fault.replica_ft=torchft` with `data.num_workers > 0`",
        "data.num_workers",
        lambda c: _torchft(c) and c.data.num_workers > 0,
        lambda c: (
            "prefetch threads read a fixed slice of every step ahead; under replica_ft the slice follows the "
            "membership of each step's quorum"
        ),
        "set data.num_workers=0 with fault.replica_ft=torchft",
    ),
    Refused(
        "`fault.replica_ft=torchft` with `train.batch_size_schedule` or `train.seq_len_schedule`",
        "fault.replica_ft",
        lambda c: _torchft(c) and (_ramp(c) or _seq_warmup(c)),
        lambda c: (
            "replica groups read slices of a fixed global batch per step (the participating groups x "
            "train.global_batch_size); a ramp or a length warmup by samples consumed would follow the membership"
        ),
        "set train.batch_size_schedule.start=0 and train.seq_len_schedule.start=0 with fault.replica_ft=torchft, or "
        "fault.replica_ft=none",
    ),
)

REFUSED = REFUSED + FLOAT8 + SCHEDULE + CHECKPOINT + BATCH_RAMP + SEQ_LEN_WARMUP + REPLICA_FT


def check_combinations(cfg: RootConfig) -> None:
    """Raise the ConfigError of the first row of ``REFUSED`` that applies to ``cfg``."""
    for row in REFUSED:
        if row.applies(cfg):
            raise ConfigError(row.key, row.reason(cfg), row.fix)


def docs_rows() -> List[str]:
    """The table as docs/configuration.md lists it (one Markdown row each, header first)."""
    rows = ["| refused combination | key named | fix |", "|---|---|---|"]
    rows += [f"| {r.when} | `{r.key}` | {r.fix} |" for r in REFUSED]
    return rows

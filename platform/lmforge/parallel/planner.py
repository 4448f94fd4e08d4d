"""The pre-queue planner: is a layout possible, does it fit, and how fast will it be?

``make_plan`` takes a config that already passed ``lmforge.config.validate.validate`` (the same checks the
trainer runs on every rank: world size = product of mesh dims, head and layer divisibility, micro batches
per pipeline stage, batch arithmetic) and adds what needs the model and the hardware:

- parameters and FLOPs per step (``lmforge.model.flops.flops_per_token``, the only FLOPs formula),
- memory per device from ``lmforge.parallel.memory_estimate`` (exact model state per shard, activations
  with and without checkpointing),
- a predicted step time from ``lmforge.parallel.step_model`` (per-op compute at the device's GEMM efficiency
  by shape, the collectives of the layout over its links, the pipeline bubble, recompute, the optimizer), and
  where it goes.

``check_fits`` refuses a layout that does not fit in device memory, naming the cheapest changes that do.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from lmforge.config.batch import BatchPlan
from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig
from lmforge.config.validate import check_batch, check_parallel_layout
from lmforge.model.flops import flops_per_token, matmul_params
from lmforge.model.gpt import kv_heads, param_count_from_config
from lmforge.model.moe import moe_layer_ids
from lmforge.parallel.device_table import DeviceSpec, device_spec
from lmforge.parallel.memory_estimate import (
    AC_MODES,
    ADAMW_STATES,
    GIB,
    MemoryEstimate,
    bytes_table,
    dtypes_for,
    estimate_memory,
    gib,
    layer_owners,
    resolve_precision,
)
from lmforge.parallel.memory_estimate import resolve_precision as resolve
from lmforge.parallel.step_model import StepTime, bubble_fraction, links_for, predict_step
from lmforge.runtime.hardware import DEVICE_MEMORY_GIB, PEAK_TFLOPS, cpu_peak_tflops
from lmforge.runtime.hardware import device_kind as cuda_kind

# Reserved on every GPU before the estimate counts: CUDA context, NCCL buffers, allocator fragmentation.
GPU_RESERVE_GIB = 2.0
GPU_RESERVE_FRACTION = 0.05


def device_kind(cfg: RootConfig) -> str:
    kind = cfg.cluster.device.lower()
    if kind != "auto":
        return kind
    import torch

    if torch.cuda.is_available():
        return cuda_kind(torch.device("cuda", 0))
    return "cpu"


def device_memory_bytes(cfg: RootConfig, kind: str) -> int:
    if cfg.cluster.device_memory_gib > 0:
        return int(cfg.cluster.device_memory_gib * GIB)
    if kind in DEVICE_MEMORY_GIB:
        return int(DEVICE_MEMORY_GIB[kind] * GIB)
    if kind == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // max(1, cfg.cluster.gpus_per_node)
    raise ConfigError(
        "cluster.device",
        f"no memory size known for device '{kind}'",
        f"set cluster.device_memory_gib, or one of: {', '.join(sorted(DEVICE_MEMORY_GIB))}, cpu",
    )


def usable_bytes(total: int, kind: str) -> int:
    if kind == "cpu":
        return total
    return int(total * (1 - GPU_RESERVE_FRACTION) - GPU_RESERVE_GIB * GIB)


def peak_tflops(kind: str, precision: str) -> float:
    dtype = "bf16" if precision in ("bf16", "bf16-mixed", "fp8") else "fp32"  # fp8: MFU against the bf16 peak
    if kind == "cpu":
        import torch

        return cpu_peak_tflops(torch.bfloat16 if dtype == "bf16" else torch.float32)
    if kind not in PEAK_TFLOPS:
        raise ConfigError(
            "cluster.device",
            f"no peak FLOP/s known for device '{kind}'",
            f"use one of: {', '.join(sorted(PEAK_TFLOPS))}, cpu",
        )
    table = PEAK_TFLOPS[kind]
    return table.get(dtype, table["bf16"])


@dataclass
class Plan:
    cfg: RootConfig
    world_size: int
    device_kind: str
    precision: str
    batch: BatchPlan
    n_params: int
    flops_per_token: int
    memory: MemoryEstimate
    device_memory: int
    usable_memory: int
    peak_tflops: float
    device: DeviceSpec
    step: StepTime
    bubble: float  # pipeline idle time relative to compute (step_model.bubble_fraction)
    warnings: List[str] = field(default_factory=list)

    @property
    def n_micro(self) -> int:
        return self.cfg.parallelism.pp_microbatches or self.batch.grad_accum

    @property
    def flops_per_step(self) -> float:
        return float(self.flops_per_token) * self.batch.tokens_per_step

    @property
    def step_time_s(self) -> float:
        return self.step.total_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch.tokens_per_step / self.step_time_s

    @property
    def model_tflops_per_device(self) -> float:
        return self.flops_per_step / self.step_time_s / self.world_size / 1e12

    @property
    def expected_mfu(self) -> float:
        return self.model_tflops_per_device / self.peak_tflops

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_memory

    @property
    def cp_exchange_bytes(self) -> int:
        return cp_exchange_bytes(self.cfg, self.batch, self.precision)

    @property
    def ep_all_to_all_bytes(self) -> int:
        return ep_all_to_all_bytes(self.cfg, self.batch, self.precision)


def cp_exchange_bytes(cfg: RootConfig, batch: BatchPlan, precision: str) -> int:
    """Bytes of K/V one cp rank sends per optimizer step (0 without cp), all its layers and micro batches.

    Per layer and micro batch a rank's K/V block is 2 * (micro * seq_len / cp) * n_kv_heads * head_dim / tp values:
    K/V travel at their own heads (grouped-query / multi-query: n_kv/n_heads of the bytes), expanded to the query
    heads only where attended. Ring: forward passes cp-1 blocks on; backward cp-1 blocks again plus cp fp32 dK/dV blocks.
    All-gather: cp-1 blocks in forward, cp-1 gradient blocks (reduce-scatter) in backward. Full activation
    checkpointing repeats the forward exchange."""
    p, m = cfg.parallelism, cfg.model
    if p.cp == 1:
        return 0
    values = 2 * batch.micro_batch_size * m.seq_len // p.cp * kv_heads(m) * (m.d_model // m.n_heads) // p.tp
    e = dtypes_for(cfg, precision).compute
    forward = (p.cp - 1) * values * e * (2 if p.activation_checkpointing == "full" else 1)
    backward = (p.cp - 1) * values * e + p.cp * values * 4 if p.cp_kv_exchange == "ring" else (p.cp - 1) * values * e
    layers = max(layers_per_pipeline_rank(cfg))  # the busiest pipeline rank's layers (its attention exchanges)
    n_micro = p.pp_microbatches or batch.grad_accum
    return layers * n_micro * (forward + backward)


def ep_all_to_all_bytes(cfg: RootConfig, batch: BatchPlan, precision: str) -> int:
    """Bytes of token rows one ep rank sends per optimizer step by all-to-all (0 without ep), assuming balanced
    routing: per MoE layer its step's ``micro * grad_accum * seq_len * top_k`` assignments of d_model values (the
    pipeline's micro batches split the same rows), of which (ep-1)/ep go to other ranks, once to dispatch and once
    to combine in forward, the same two (gradients) in backward, and the forward pair again under full activation
    checkpointing; over the MoE layers of the pipeline rank holding most (``moe_layers_per_pipeline_rank``). With
    tp every tp rank routes and dispatches its whole sequence (gathered first under sequence parallelism) over its
    own ep group, so tp does not divide the rows. The counts exchange (E integers) is left out."""
    p, m = cfg.parallelism, cfg.model
    if p.ep == 1:
        return 0
    rows = batch.micro_batch_size * batch.grad_accum * m.seq_len * m.moe.top_k
    exchanges = 4 + (2 if p.activation_checkpointing == "full" else 0)
    per_layer = rows * m.d_model * dtypes_for(cfg, precision).compute * (p.ep - 1) // p.ep * exchanges
    return moe_layers_per_pipeline_rank(cfg) * per_layer


def layers_per_pipeline_rank(cfg: RootConfig) -> List[int]:
    """Blocks held by each pipeline rank, from the stage map (``parallelism.pp_layers``) and the placement."""
    owners = layer_owners(cfg)
    return [owners.count(rank) for rank in range(cfg.parallelism.pp)]


def moe_layers_per_pipeline_rank(cfg: RootConfig) -> int:
    """MoE layers held by the pipeline rank holding the most (every MoE layer without pp)."""
    p, m = cfg.parallelism, cfg.model
    ids = moe_layer_ids(m)
    if p.pp == 1:
        return len(ids)
    every = layer_owners(cfg)
    owners = [every[layer] for layer in ids]
    return max(owners.count(rank) for rank in range(p.pp))


def make_plan(
    cfg: RootConfig, world_size: Optional[int] = None, peak: Optional[float] = None, device: Optional[DeviceSpec] = None
) -> Plan:
    """Plan a validated config. ``peak`` overrides the peak table (TFLOP/s per device; on CPU also the GEMM rate);
    ``device`` the device table's entry (a measured CPU, a calibration)."""
    world = world_size or cfg.cluster.nodes * cfg.cluster.gpus_per_node
    kind = device_kind(cfg)
    precision = resolve_precision(cfg.train.precision, kind)
    batch = check_batch(cfg)
    memory = estimate_memory(cfg, batch, precision)
    total_mem = device_memory_bytes(cfg, kind)
    p = cfg.parallelism
    warnings = []
    if p.tp > cfg.cluster.gpus_per_node:
        warnings.append(
            f"tp={p.tp} spans nodes ({cfg.cluster.gpus_per_node} devices per node): tensor-parallel "
            "collectives then cross the slower inter-node network"
        )
    peak_value = peak if peak is not None else peak_tflops(kind, precision)
    spec = device or device_spec(
        kind, measured_tflops=cfg.cluster.gemm_tflops, cpu_tflops=peak_value if kind == "cpu" else 0.0
    )
    step = predict_step(
        cfg,
        batch,
        precision,
        spec,
        links_for(cfg, spec),
        cp_bytes=cp_exchange_bytes(cfg, batch, precision),
        ep_bytes=ep_all_to_all_bytes(cfg, batch, precision),
    )
    return Plan(
        cfg=cfg,
        world_size=world,
        device_kind=kind,
        precision=precision,
        batch=batch,
        n_params=param_count_from_config(cfg.model),
        flops_per_token=flops_per_token(cfg.model),
        memory=memory,
        device_memory=total_mem,
        usable_memory=usable_bytes(total_mem, kind),
        peak_tflops=peak_value,
        device=spec,
        step=step,
        bubble=bubble_fraction(cfg, p.pp_microbatches or batch.grad_accum),
        warnings=warnings,
    )


# ---- refusing layouts that do not fit, with the changes that would fit ------------------------------


def _with(cfg: RootConfig, **changes) -> RootConfig:
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        group, name = key.split("__")
        setattr(getattr(new, group), name, value)
    return new


def _candidates(cfg: RootConfig) -> List[Tuple[str, RootConfig]]:
    """Alternative layouts on the same devices, cheapest change first: (override text, config)."""
    p, t = cfg.parallelism, cfg.train
    out: List[Tuple[str, RootConfig]] = []
    for mode in ("selective", "full"):
        current = AC_MODES.index(p.activation_checkpointing) if p.activation_checkpointing in AC_MODES else 1
        if AC_MODES.index(mode) > current:
            out.append(
                (f"parallelism.activation_checkpointing={mode}", _with(cfg, parallelism__activation_checkpointing=mode))
            )
    layouts: List[Tuple[str, dict]] = []
    if p.dp_replicate > 1:
        layouts.append(
            (
                f"parallelism.dp_shard={p.dp_shard * p.dp_replicate} parallelism.dp_replicate=1",
                dict(parallelism__dp_shard=p.dp_shard * p.dp_replicate, parallelism__dp_replicate=1),
            )
        )
    if p.dp_shard > 1 and p.reshard_after_forward is False:
        layouts.append(("parallelism.reshard_after_forward=true", dict(parallelism__reshard_after_forward=True)))
    mb = t.micro_batch_size // 2
    while mb >= 1:
        change = dict(train__micro_batch_size=mb)
        if t.grad_accum is not None:
            change["train__grad_accum"] = t.grad_accum * t.micro_batch_size // mb
        layouts.append((f"train.micro_batch_size={mb}", change))
        mb //= 2
    for dim in ("tp", "pp"):
        current = getattr(p, dim)
        for size in (2, 4, 8, 16):
            ratio = size // current
            if size <= current or size % current or (dim == "tp" and size > cfg.cluster.gpus_per_node):
                continue
            for dp_dim in ("dp_shard", "dp_replicate"):
                dp = getattr(p, dp_dim)
                if dp % ratio == 0:
                    layouts.append(
                        (
                            f"parallelism.{dim}={size} parallelism.{dp_dim}={dp // ratio}",
                            {f"parallelism__{dim}": size, f"parallelism__{dp_dim}": dp // ratio},
                        )
                    )
                    break
    for text, change in layouts:
        out.append((text, _with(cfg, **change)))
        if p.activation_checkpointing != "full":
            out.append(
                (
                    f"{text} parallelism.activation_checkpointing=full",
                    _with(cfg, parallelism__activation_checkpointing="full", **change),
                )
            )
    return out


def suggest_fixes(plan: Plan, limit: int = 2) -> List[Tuple[str, float]]:
    """Up to ``limit`` valid alternative layouts that fit, as (overrides, estimated GiB per device)."""
    found = []
    for text, cand in _candidates(plan.cfg):
        try:
            check_parallel_layout(cand, plan.world_size)
            batch = check_batch(cand)
        except ConfigError:
            continue
        est = estimate_memory(cand, batch, plan.precision)
        if est.total <= plan.usable_memory:
            found.append((text, gib(est.total)))
            if len(found) == limit:
                break
    return found


def check_fits(plan: Plan) -> None:
    """Raise ConfigError naming the overflow and the cheapest layouts that fit."""
    if plan.fits:
        return
    m = plan.memory
    where = f" on pipeline rank {m.pp_rank}" if plan.cfg.parallelism.pp > 1 else ""
    reason = (
        f"estimated {gib(m.total):.1f} GiB per device{where} exceeds the {gib(plan.usable_memory):.1f} GiB "
        f"usable of {gib(plan.device_memory):.0f} GiB on {plan.device_kind} (parameters+gradients+optimizer "
        f"{gib(m.state.total):.1f} GiB, activations {gib(m.activations):.1f} GiB)"
    )
    fixes = suggest_fixes(plan)
    if fixes:
        fix = " or ".join(f"{text} ({est:.1f} GiB)" for text, est in fixes)
    else:
        fix = "no change on these devices fits: add nodes (cluster.nodes) and raise parallelism.dp_shard, or use larger devices"
    raise ConfigError("parallelism", reason, fix)


# ---- presentation -------------------------------------------------------------------------------------


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def mesh_placement(cfg: RootConfig) -> str:
    """Where each mesh dim's groups fall: ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp)."""
    p, per_node = cfg.parallelism, cfg.cluster.gpus_per_node
    stride, parts = 1, []
    for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
        size = getattr(p, name)
        if size > 1:
            span = stride * size
            where = "within a node" if span <= per_node else f"across {-(-span // per_node)} nodes"
            parts.append(f"{name} groups {where}")
        stride *= size
    return "; ".join(parts) if parts else "one device"


def format_plan(plan: Plan) -> str:
    cfg, p, m, b = plan.cfg, plan.cfg.parallelism, plan.cfg.model, plan.batch
    mem = plan.memory
    lines = [
        f"plan       {cfg.model.name} on {cfg.cluster.nodes} x {cfg.cluster.gpus_per_node} {plan.device_kind} "
        f"(world size {plan.world_size}), precision {plan.precision}",
        f"mesh       pp={p.pp} x dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard}"
        + (f" x cp={p.cp}" if p.cp > 1 else "")
        + (f" (ep={p.ep} within dp_shard)" if p.ep > 1 else "")
        + f" x tp={p.tp}"
        f"  ({mesh_placement(cfg)})",
        f"           pp schedule {p.pp_schedule if p.pp > 1 else '-'}, virtual stages {p.pp_virtual_stages}, "
        f"sequence_parallel {p.sequence_parallel}, activation_checkpointing {p.activation_checkpointing}, "
        f"reshard_after_forward {p.reshard_after_forward}",
    ]
    if p.pp > 1 and p.pp_layers is not None:
        lines.append(
            f"           stage map pp_layers {list(p.pp_layers)}: blocks per pipeline rank "
            f"{layers_per_pipeline_rank(cfg)}"
        )
    lines += [
        f"model      {plan.n_params:,} parameters ({matmul_params(m):,} in matmuls), {m.n_layers} layers, "
        f"d_model {m.d_model}, heads {m.n_heads}/{m.n_kv_heads or m.n_heads} kv, seq_len {m.seq_len}",
        f"batch      {b.global_batch_size} sequences = micro {b.micro_batch_size} x grad_accum {b.grad_accum} "
        f"x dp {b.dp_size}; {b.tokens_per_step:,} tokens/step"
        + (f"; {plan.n_micro} pipeline micro batches" if p.pp > 1 else ""),
    ]
    if p.cp > 1:
        lines.append(
            f"cp         {p.cp} ranks per sequence ({p.cp_kv_exchange}): {m.seq_len // p.cp} of {m.seq_len} tokens "
            f"per rank (chunks of {m.seq_len // (2 * p.cp)}); K/V exchange {gib(plan.cp_exchange_bytes):.3f} GiB "
            f"per rank and step"
        )
    if p.ep > 1:  # expert parallelism: experts per rank, their state, the token all-to-all
        st = mem.state
        expert_bytes = st.expert_numel * (2 + ADAMW_STATES) * mem.dtypes.param
        where = (f" in each of its {moe_layers_per_pipeline_rank(cfg)} MoE layers" if p.pp > 1 else "") + (
            f", replicated over tp {p.tp}" if p.tp > 1 else ""
        )
        lines.append(
            f"ep         {p.ep} ranks per expert group (of dp_shard {p.dp_shard}): {m.moe.experts // p.ep} of "
            f"{m.moe.experts} experts per rank{where}, FSDP over {p.dp_shard // p.ep}; experts' "
            f"parameters+gradients+AdamW {gib(expert_bytes):.3f} GiB per device; token all-to-all "
            f"{gib(plan.ep_all_to_all_bytes):.3f} GiB per rank and step"
        )
    lines += [
        f"FLOPs      {_si(plan.flops_per_token, 'FLOP')}/token (6N + attention), {_si(plan.flops_per_step, 'FLOP')}/step",
        "memory     per device, most loaded rank" + (f" (pipeline rank {mem.pp_rank})" if p.pp > 1 else "") + ":",
    ]
    for name, n in bytes_table(mem):
        lines.append(f"  {name:<30} {gib(n):9.2f} GiB")
    lines.append(
        f"  {'total':<30} {gib(mem.total):9.2f} GiB of {gib(plan.usable_memory):.1f} usable "
        f"({gib(plan.device_memory):.0f} GiB {plan.device_kind})"
    )
    alt = " | ".join(f"{mode} {gib(mem.activations_by_mode[mode]):.2f}" for mode in AC_MODES)
    lines.append(f"  activations by checkpointing: {alt} GiB; total with full: {gib(mem.total_with('full')):.2f} GiB")
    if p.pp > 1:
        lines.append(
            "  per pipeline rank: "
            + ", ".join(f"{r}: {gib(v):.2f}" for r, v in sorted(mem.per_stage_total.items()))
            + " GiB"
        )
    lines += step_lines(plan)
    for w in plan.warnings:
        lines.append(f"warning    {w}")
    lines.append("fits       yes" if plan.fits else "fits       NO")
    return "\n".join(lines)


STEP_ROWS_ALWAYS = ("compute", "exposed TP comm", "PP bubble", "exposed DP comm", "optimizer")


def step_lines(plan: Plan) -> List[str]:
    """The predicted step and where its time goes (rows always shown, others when non-zero)."""
    st, total = plan.step, plan.step_time_s
    lines = [
        f"step time  {total:.3f} s predicted -> {plan.tokens_per_s:,.0f} tokens/s "
        f"({plan.tokens_per_s / plan.world_size:,.0f} per device), {plan.model_tflops_per_device:.1f} model TFLOP/s "
        f"per device (MFU {plan.expected_mfu:.1%} of {plan.peak_tflops:.1f})"
    ]
    for name, seconds in st.rows():
        if name not in STEP_ROWS_ALWAYS and seconds == 0:
            continue
        note = ""
        if name == "compute":
            note = f"  GEMMs {st.gemm_share:.0%} of compute" + (
                f", recompute {st.recompute_s:.3f} s" if st.recompute_s else ""
            )
        elif name == "exposed DP comm" and st.dp_comm_total_s:
            note = f"  of {st.dp_comm_total_s:.3f} s issued"
        lines.append(f"  {name:<30} {seconds:9.3f} s {seconds / total:6.1%}{note}")
    if st.groups:
        lines.append("links      " + "; ".join(g.describe() for g in st.groups))
    return lines


def warn_if_over_memory(cfg: RootConfig, total_bytes: int, kind: str, emit: Callable[[str], None] = print) -> bool:
    """Start-up check of the trainer on a real device: warn (not fail) when the estimate exceeds memory."""
    batch = check_batch(cfg)
    est = estimate_memory(cfg, batch, resolve(cfg.train.precision, kind))
    usable = usable_bytes(total_bytes, kind)
    if est.total <= usable:
        return False
    emit(
        f"lmforge: warning: the planner estimates {gib(est.total):.1f} GiB per device but {gib(usable):.1f} GiB "
        f"are usable on this {kind}; run `lmforge plan` with these overrides for fixes"
    )
    return True


def run_prediction(cfg: RootConfig, device, world_size: int, peak: float) -> Dict[str, float]:
    """The planner's figures for a run on the device it starts on, as metrics fields (the trainer logs them beside
    what it measures): step time, tokens/s, MFU and peak memory per device. ``peak``: the trainer's own peak
    TFLOP/s (on the CPU, the measured GEMM rate; on a GPU the device table's). Raises ConfigError when the device
    has no entry in the tables."""
    kind = cuda_kind(device) if getattr(device, "type", "cpu") == "cuda" else "cpu"
    plan = make_plan(_with(cfg, cluster__device=kind), world_size, peak=peak if kind == "cpu" else None)
    return {
        "predicted_step_time_s": plan.step_time_s,
        "predicted_tokens_per_s": plan.tokens_per_s,
        "predicted_mfu": plan.expected_mfu,
        "predicted_peak_memory_gib": gib(plan.memory.total),
    }


def prediction_gap(record: dict, tolerance: float = 0.25) -> Optional[str]:
    """What a GPU run warns once about: measured step time or peak memory more than ``tolerance`` away from the
    prediction in a train record (None: within it, or nothing to compare)."""
    gaps = []
    for measured, predicted, what in (
        ("step_time_s", "predicted_step_time_s", "step time"),
        ("peak_memory_gib", "predicted_peak_memory_gib", "peak memory"),
    ):
        m, p = record.get(measured), record.get(predicted)
        if m and p and abs(m / p - 1) > tolerance:
            gaps.append(f"{what} {m:.3g} measured vs {p:.3g} predicted ({m / p:.2f}x)")
    if not gaps:
        return None
    return (
        f"the planner's prediction is off by more than {tolerance:.0%} at step {record.get('step')}: "
        + "; ".join(gaps)
        + ". `lmforge plan` with this run's overrides shows where it puts the time; cluster.gemm_tflops or a "
        "`lmforge comm bench` file gives it this machine's measured rates"
    )


def startup_memory_check(cfg: RootConfig, device, rank: int) -> None:
    """Called by the trainer on start-up: on a GPU, rank 0 warns when the planner's estimate does not fit."""
    if getattr(device, "type", "cpu") != "cuda" or rank != 0:
        return
    import torch

    warn_if_over_memory(cfg, torch.cuda.get_device_properties(device).total_memory, cuda_kind(device))

"""The step-time model: where one optimizer step's time goes on the busiest rank of a layout.

``predict_step`` builds the step from the work, not from an assumed utilisation:

- **compute** of one micro batch on one pipeline rank: every GEMM of its blocks at its real shape (QKV, output
  projection, MLP; forward, input-gradient and weight-gradient GEMMs; the head on the last stage), each timed by
  ``device_table.gemm_time`` (the device's large-GEMM rate, wave quantisation of its output tiles, and the
  bytes it moves); the attention core at its causal FLOPs (half the square: 2 s^2 d forward per sequence,
  2.5 x that backward, the flash-attention count) at the device's attention rate; the element-wise work (norms,
  residual adds, activations, rotary, the loss over the logits) as bytes through HBM (a fused kernel's bytes on a
  GPU; on a CPU, which runs them op by op, the bytes every eager op moves, ``host_overhead.eager_block_bytes``). Tensor parallelism
  divides the widths, context parallelism the tokens, MoE layers run ``top_k`` routed experts per token.
- **in-step efficiency**: kernels inside a training step run slower than the same kernels benchmarked alone
  (collectives' kernels share the SMs, caches are cold, the host launches between them): every compute time
  above is divided by the device's ``in_step_efficiency`` (``device_table.IN_STEP_EFFICIENCY`` on GPUs, the one
  fitted parameter of the model; 1 on CPU, where the measured GEMM rate is already in-process).
- **recompute**: ``full`` runs every block's forward again before its backward; ``selective`` re-runs only the
  element-wise ops (matmul and attention outputs are kept; with ``selective_matmuls=alternate`` also the even
  matmuls' forward GEMMs); ``modules`` the parts ``recompute_modules`` names
  (attention core, MLP, norms); all of it for the checkpointed blocks only (``parallelism.recompute_layers``).
- **fp8** (``train.precision=fp8``): the blocks' Linears at the device's fp8 rate, plus the bytes of their dynamic
  scaling and casts (``FP8_CAST_BYTES``); attention, element-wise work and the head in bf16.
- **host dispatch** (``host_time``): the step's ATen ops (``host_overhead``) times the device's host time per op,
  all of it on a CPU, what exceeds the device's work on a GPU (its host runs ahead).
- **pipeline**: the step is ``m`` micro batches on the slowest stage plus the bubble of the schedule,
  ``(pp - 1) / v`` stage-micro-batch times (v virtual stages of an interleaved schedule, a third of that for
  the zero-bubble schedules, Qi et al. 2023), and the point-to-point sends of activations between stages
  (forward and backward of each micro batch and chunk).
- **tensor parallelism**: per block and micro batch, two all-reduces of the ``B * s * d`` activations in
  forward and two in backward (or, with sequence parallelism, all-gathers and reduce-scatters of the same bus
  bytes), two more with full recompute; on the critical path (not overlapped).
- **data parallelism**: DDP all-reduces the gradients once per step, in buckets during the last backward
  (exposed: what does not fit under that backward, plus the last bucket); FSDP all-gathers each block's
  parameters in forward (and again in backward with ``reshard_after_forward``) and reduce-scatters its gradients
  (every micro batch, or once with ``fsdp_grad_sync=last_microbatch``; with ``reshard_after_forward=false`` too,
  the blocks stay gathered for the step and are gathered once), prefetched one block ahead, so what is
  exposed is what exceeds the compute it overlaps plus one block's share; HSDP adds the all-reduce of the shard
  over ``dp_replicate``.
- **context parallelism**: the ring's K/V exchange (``planner.cp_exchange_bytes``) overlaps the attention of
  the block; what exceeds it is exposed. **Expert parallelism**: the token all-to-all
  (``planner.ep_all_to_all_bytes``), exposed.
- **optimizer**: AdamW is memory-bound: read parameter, gradient and both moments, write parameter and moments,
  plus the gradient-norm pass: 8 x the parameter bytes of the rank's shard, through HBM.

Collectives run over the links of ``device_table``: a mesh dim's group stays inside a node when its span
(stride x size in lmforge's row-major mesh order pp, dp_replicate, dp_shard, cp, tp) fits in one node, and
crosses nodes otherwise, with ``k`` of its ranks per node sharing ``k`` NICs (one per GPU). A collective of
``S`` bytes on ``n`` ranks takes nccl-tests' bus bytes (all-reduce ``2(n-1)/n * S``, all-gather and
reduce-scatter ``(n-1)/n * S``) over the bus bandwidth, plus a per-hop latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from lmforge.config.batch import BatchPlan
from lmforge.config.parallelism import ZERO_BUBBLE_SCHEDULES, fsdp_grad_sync_mode, pipeline_chunks
from lmforge.config.schema import RootConfig
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import kv_heads
from lmforge.model.moe import expert_hidden_dim, moe_layer_ids
from lmforge.parallel.device_table import (
    Bandwidth,
    DeviceSpec,
    LinkSpec,
    bench_bandwidth,
    gemm_time,
    link_spec,
    memory_time,
)
from lmforge.parallel.memory_estimate import (
    checkpointed_blocks,
    dtypes_for,
    fsdp_degree,
    layer_owners,
    state_bytes,
)

# Zero-bubble schedules (ZB-H1 / ZBV, Qi et al. 2023) leave about a third of 1F1B's bubble.
ZERO_BUBBLE_FACTOR = 1.0 / 3.0
# Flash-attention backward does 2.5 x the forward's matmul FLOPs (5 matmuls against 2, Dao 2023).
ATTENTION_BACKWARD_FLOPS = 2.5
# Element-wise bytes per token and block, forward, in units of d_model (residual dtype): two norms (read +
# write), two residual adds (read two, write one), rotary on q and k; and in units of the FFN width (compute
# dtype): the activation (SwiGLU reads two, writes one; GELU reads one, writes one). Backward moves twice these.
ELEMENTWISE_D = 2 * 2 + 2 * 3 + 4
NORM_BYTES_D = 2 * 2
ELEMENTWISE_F = {"swiglu": 3, "gelu": 2}
# Bytes per logit of the loss, forward + backward (fp32 softmax read/write in chunks, the gradient written).
LOSS_BYTES_PER_LOGIT = 16
# Where the loss is measured as one rate (``DeviceSpec.loss_rate``, forward + backward): the forward's share, its
# log-softmax pass against the backward's softmax pass and gradient write (a quarter: the chunked cross-entropy's
# forward measured at 0.23 and 0.28 of its forward + backward on a 2-core EPYC, 1024 x 50257 and 512 x 8192 logits).
LOSS_FORWARD_SHARE = 0.25
# AdamW + gradient-norm pass: read p, g, m, v, write p, m, v, read g again: 8 x the parameter bytes.
OPTIMIZER_BYTES_PER_PARAM_BYTE = 8
# Float8 linears with dynamic tensorwise scaling (torchao Float8Linear): each of input, weight and output gradient
# is read for its amax and read again and written in float8 (2 + 2 + 1 bytes per element), and its transposed float8
# copy for the other GEMM that reads it is written from it (1 + 1).
FP8_CAST_BYTES = (5, 2)
# DDP buckets (``parallelism.ddp_bucket_cap_mb``'s default is 25 MB); the last one cannot overlap.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Links:
    """The links a layout's collectives use: NVLink within a node, the NIC across nodes, or measured curves."""

    intra: LinkSpec
    inter: LinkSpec
    gpus_per_node: int
    measured_intra: Optional[Bandwidth] = None
    measured_inter: Optional[Bandwidth] = None


@dataclass(frozen=True)
class Group:
    """One mesh dim's process group as the step model sees it."""

    name: str
    size: int
    crosses_nodes: bool
    bus_gbps: float  # sustained bus bandwidth of a large collective
    latency_s: float
    measured: Optional[Bandwidth] = None

    def describe(self) -> str:
        where = "across nodes" if self.crosses_nodes else "within a node"
        src = "measured" if self.measured is not None else f"{self.bus_gbps:.0f} GB/s"
        return f"{self.name}={self.size} {where} ({src})"

    def _bw(self, size: float) -> float:
        return (self.measured.gbps(size) if self.measured is not None else self.bus_gbps) * 1e9

    def all_reduce(self, n_bytes: float) -> float:
        if self.size == 1 or n_bytes <= 0:
            return 0.0
        n = self.size
        return 2 * (n - 1) / n * n_bytes / self._bw(n_bytes) + 2 * (n - 1) * self.latency_s

    def all_gather(self, n_bytes: float) -> float:
        """``n_bytes`` = the gathered (full) size; reduce-scatter of a full-size input costs the same."""
        if self.size == 1 or n_bytes <= 0:
            return 0.0
        n = self.size
        return (n - 1) / n * n_bytes / self._bw(n_bytes) + (n - 1) * self.latency_s

    reduce_scatter = all_gather
    all_to_all = all_gather

    def send(self, n_bytes: float, link_gbps: float) -> float:
        if self.size == 1 or n_bytes <= 0:
            return 0.0
        return n_bytes / (link_gbps * 1e9) + self.latency_s


def mesh_group(cfg: RootConfig, links: Links, name: str) -> Group:
    """The group of mesh dim ``name`` (``ep``: the inner ``ep`` ranks of dp_shard)."""
    p = cfg.parallelism
    sizes = {d: getattr(p, d) for d in MESH_ORDER}
    if name == "ep":
        size, stride = p.ep, p.cp * p.tp
    else:
        size = sizes[name]
        stride = math.prod(sizes[d] for d in MESH_ORDER[MESH_ORDER.index(name) + 1 :])
    per_node = links.gpus_per_node
    crosses = stride * size > per_node
    if not crosses:
        return Group(name, size, False, links.intra.bus_gbps, links.intra.latency_s, links.measured_intra)
    k = max(1, per_node // stride)  # ranks of the group on one node, each with its own NIC
    bus = min(links.intra.bus_gbps, k * links.inter.bus_gbps)
    return Group(name, size, True, bus, links.inter.latency_s, links.measured_inter)


@dataclass
class StepTime:
    """Seconds of one optimizer step on the busiest rank, by where they go (``total_s`` adds them)."""

    compute_s: float  # forward + backward of all micro batches on the slowest stage, recompute included
    recompute_s: float  # the part of compute_s that is recompute
    tp_comm_s: float  # exposed tensor-parallel collectives
    pp_bubble_s: float
    pp_comm_s: float  # point-to-point sends between stages
    dp_comm_s: float  # exposed data-parallel / FSDP collectives
    dp_comm_total_s: float  # the same before overlap with compute
    cp_comm_s: float  # exposed context-parallel K/V exchange
    ep_comm_s: float  # expert all-to-all
    optimizer_s: float
    host_s: float = 0.0  # host dispatch of the step's ops not hidden under the device's work
    groups: List[Group] = field(default_factory=list)
    gemm_share: float = 0.0  # share of compute in GEMMs (the rest: attention core, element-wise)

    @property
    def total_s(self) -> float:
        return sum(v for _, v in self.rows())

    def rows(self) -> List[Tuple[str, float]]:
        return [
            ("compute", self.compute_s),
            ("exposed TP comm", self.tp_comm_s),
            ("PP bubble", self.pp_bubble_s),
            ("PP sends", self.pp_comm_s),
            ("exposed DP comm", self.dp_comm_s),
            ("exposed CP exchange", self.cp_comm_s),
            ("EP all-to-all", self.ep_comm_s),
            ("optimizer", self.optimizer_s),
            ("host dispatch", self.host_s),
        ]


@dataclass
class _Pass:
    """Seconds of one block (or the head) for one micro batch: forward GEMMs, backward GEMMs, attention, bytes."""

    fwd_gemm: float = 0.0
    bwd_gemm: float = 0.0
    fwd_attn: float = 0.0
    bwd_attn: float = 0.0
    fwd_elementwise: float = 0.0
    bwd_elementwise: float = 0.0
    fwd_mlp: float = 0.0  # the MLP's share of the forward (its GEMMs and activation), for modules recompute
    fwd_norms: float = 0.0  # the norms' share of the forward element-wise bytes
    fwd_even_gemm: float = 0.0  # the forward GEMMs selective_matmuls=alternate recomputes (wk, wo, w3 / w2)

    @property
    def forward(self) -> float:
        return self.fwd_gemm + self.fwd_attn + self.fwd_elementwise

    @property
    def backward(self) -> float:
        return self.bwd_gemm + self.bwd_attn + self.bwd_elementwise


def _linear(spec: DeviceSpec, out: _Pass, n: int, k: int, width: int, dtype: str, e: int, count: int = 1) -> None:
    """A Linear of ``k`` -> ``width`` on ``n`` tokens: forward, input-gradient and weight-gradient GEMMs (float8:
    plus the dynamic scaling and casts of input and weight in forward, of the output gradient and the transposed
    copies in backward, ``FP8_CAST_BYTES``)."""
    g = 1 if dtype == "fp8" else e
    out.fwd_gemm += count * gemm_time(spec, n, k, width, dtype=dtype, bytes_per=g)
    out.bwd_gemm += count * (
        gemm_time(spec, n, width, k, dtype=dtype, bytes_per=g) + gemm_time(spec, k, n, width, dtype=dtype, bytes_per=g)
    )
    if dtype == "fp8":
        amax_cast, transpose = FP8_CAST_BYTES
        out.fwd_gemm += count * memory_time(spec, amax_cast * (n * k + k * width))
        out.bwd_gemm += count * memory_time(spec, amax_cast * n * width + transpose * (n * k + k * width + n * width))


def block_pass(
    cfg: RootConfig, spec: DeviceSpec, micro: int, *, moe: bool, dtype: str, e: int, r: int, linear_dtype: str = ""
) -> _Pass:
    """One transformer block, one micro batch, on one (tp, cp) rank. ``linear_dtype``: the Linears' GEMM dtype
    (fp8 under ``train.precision=fp8``; ``dtype`` otherwise); attention and element-wise work stay in ``dtype``."""
    m, p = cfg.model, cfg.parallelism
    tp = p.tp
    attn_dtype, dtype = dtype, linear_dtype or dtype
    n = micro * m.seq_len // p.cp
    d, hd = m.d_model, m.d_model // m.n_heads
    d_kv = kv_heads(m) * hd
    out = _Pass()
    _linear(spec, out, n, d, (d + 2 * d_kv) // tp, dtype, e)  # wq, wk, wv
    _linear(spec, out, n, d // tp, d, dtype, e)  # wo
    mats = 3 if m.mlp == "swiglu" else 2
    out.fwd_even_gemm = gemm_time(spec, n, d, d_kv // tp, dtype=dtype, bytes_per=e) + gemm_time(
        spec, n, d // tp, d, dtype=dtype, bytes_per=e
    )  # wk, wo
    before_mlp = out.fwd_gemm
    if moe:
        mo = m.moe
        fe = expert_hidden_dim(m)
        _linear(spec, out, n, d, mo.experts, dtype, e)  # router
        local_experts = max(1, mo.experts // p.ep)
        rows = max(1, n * mo.top_k * p.ep // mo.experts)  # balanced routing: rows per local expert
        _linear(spec, out, rows, d, fe, dtype, e, count=local_experts * (mats - 1))
        _linear(spec, out, rows, fe, d, dtype, e, count=local_experts)
        if mo.shared_experts:
            _linear(spec, out, n, d, mo.shared_experts * fe, dtype, e, count=mats - 1)
            _linear(spec, out, n, mo.shared_experts * fe, d, dtype, e)
        f_local = (mo.top_k + mo.shared_experts) * fe
    else:
        f = ffn_hidden_dim(m)
        _linear(spec, out, n, d, f // tp, dtype, e, count=mats - 1)  # w1 (and w3)
        _linear(spec, out, n, f // tp, d, dtype, e)  # w2
        out.fwd_even_gemm += gemm_time(spec, n, d, f // tp, dtype=dtype, bytes_per=e)  # w3 (SwiGLU) or w2 (GELU)
        f_local = f // tp
    # causal attention core: QK^T and AV over the lower triangle; a cp rank holds 1/cp of the queries (balanced)
    mlp_gemm = out.fwd_gemm - before_mlp
    attn_flops = 2.0 * micro * m.seq_len * m.seq_len * d / (tp * p.cp)
    fwd_frac, bwd_frac = spec.attention_fraction
    rate = spec.peak(attn_dtype) if spec.measured_tflops <= 0 else spec.gemm_rate(attn_dtype)
    out.fwd_attn = attn_flops / (rate * fwd_frac) + spec.kernel_overhead_s
    out.bwd_attn = ATTENTION_BACKWARD_FLOPS * attn_flops / (rate * bwd_frac) + spec.kernel_overhead_s
    sp = tp if p.sequence_parallel else 1
    elementwise = n * (ELEMENTWISE_D * d * r / sp + ELEMENTWISE_F[m.mlp] * f_local * e)
    out.fwd_elementwise = memory_time(spec, elementwise)
    out.fwd_mlp = mlp_gemm + memory_time(spec, n * ELEMENTWISE_F[m.mlp] * f_local * e)
    out.fwd_norms = memory_time(spec, n * NORM_BYTES_D * d * r / sp)
    out.bwd_elementwise = 2 * out.fwd_elementwise
    if spec.eager_elementwise and not moe:
        fwd_bytes, bwd_bytes = _eager_block_bytes(cfg, micro, e)
        out.fwd_elementwise, out.bwd_elementwise = memory_time(spec, fwd_bytes), memory_time(spec, bwd_bytes)
    return out


def _eager_block_bytes(cfg: RootConfig, micro: int, e: int) -> Tuple[float, float]:
    """A CPU's element-wise bytes of one block (``host_overhead.eager_block_bytes``, counted in fp32: scaled to
    ``e`` bytes per element), split over the tensor- and context-parallel ranks."""
    # deferred: counting builds the model on the meta device, only for a device that runs it eagerly (CPU)
    from lmforge.parallel.host_overhead import eager_block_bytes

    p = cfg.parallelism
    share = e / 4 / (p.tp * p.cp)
    fwd_bytes, bwd_bytes = eager_block_bytes(cfg, micro)
    return fwd_bytes * share, bwd_bytes * share


def head_pass(cfg: RootConfig, spec: DeviceSpec, micro: int, *, dtype: str, e: int) -> _Pass:
    """Final norm, output projection and the loss, one micro batch (last pipeline stage)."""
    m, p = cfg.model, cfg.parallelism
    n = micro * m.seq_len // p.cp
    out = _Pass()
    _linear(spec, out, n, m.d_model, m.vocab_size // p.tp, dtype, e)
    logits = n * m.vocab_size // p.tp
    out.fwd_elementwise = memory_time(spec, logits * LOSS_BYTES_PER_LOGIT / 2)
    out.bwd_elementwise = out.fwd_elementwise
    if spec.loss_rate > 0:  # measured where exp binds (CPU): forward one exp pass, backward one and the gradient
        out.fwd_elementwise = max(out.fwd_elementwise, LOSS_FORWARD_SHARE * logits / spec.loss_rate)
        out.bwd_elementwise = max(out.bwd_elementwise, (1 - LOSS_FORWARD_SHARE) * logits / spec.loss_rate)
    return out


def compute_dtype(cfg: RootConfig, precision: str) -> str:
    """The dtype of attention and element-wise work (and of the Linears but under fp8)."""
    return "bf16" if precision in ("bf16", "bf16-mixed", "fp8") else "fp32"


@dataclass
class _Stage:
    forward: float  # one micro batch, forward (no recompute)
    backward: float  # one micro batch, backward, recompute included
    recompute: float
    attention: float  # attention core, forward + backward (what the cp exchange overlaps)
    gemm: float
    layers: int


def block_recompute(cfg: RootConfig, b: _Pass) -> float:
    """Seconds one checkpointed block recomputes before its backward, under ``parallelism.activation_checkpointing``."""
    p = cfg.parallelism
    mode = p.activation_checkpointing
    if mode == "full":
        return b.forward
    if mode == "selective":
        return b.fwd_elementwise + (b.fwd_even_gemm if p.selective_matmuls == "alternate" else 0.0)
    if mode == "modules":  # the parts named by recompute_modules
        parts = set(p.recompute_modules)
        return (
            (b.fwd_attn if "attention_core" in parts else 0.0)
            + (b.fwd_mlp if "mlp" in parts else 0.0)
            + (b.fwd_norms if "norms" in parts else 0.0)
        )
    return 0.0


def stage_time(cfg: RootConfig, spec: DeviceSpec, micro: int, precision: str, pp_rank: int) -> _Stage:
    """One micro batch on pipeline rank ``pp_rank``: its blocks, and the head on the last stage. Of its blocks the
    ``checkpointed_blocks`` recompute (``parallelism.recompute_layers``)."""
    m, p = cfg.model, cfg.parallelism
    dt = dtypes_for(cfg, precision)
    dtype = compute_dtype(cfg, precision)
    e = dt.compute  # activation bytes (fp8: bf16-mixed's, memory_estimate.dtypes_for), float8 GEMMs in the Linears
    linear_dtype = "fp8" if precision == "fp8" else dtype
    moe_ids = set(moe_layer_ids(m))
    owned = [layer for layer, owner in enumerate(layer_owners(cfg)) if owner == pp_rank]
    checkpointed = checkpointed_blocks(cfg, pp_rank) if p.activation_checkpointing != "none" else 0
    share = checkpointed / len(owned) if owned else 0.0
    cache: Dict[bool, _Pass] = {}
    fwd = bwd = recompute = attention = gemm = 0.0
    for layer in owned:
        moe = layer in moe_ids
        if moe not in cache:
            cache[moe] = block_pass(
                cfg, spec, micro, moe=moe, dtype=dtype, e=e, r=dt.residual, linear_dtype=linear_dtype
            )
        b = cache[moe]
        fwd += b.forward
        bwd += b.backward
        attention += b.fwd_attn + b.bwd_attn
        gemm += b.fwd_gemm + b.bwd_gemm
        recompute += share * block_recompute(cfg, b)
        if p.activation_checkpointing == "full":
            gemm += share * b.fwd_gemm
    chunks = pipeline_chunks(p)
    last_rank = (chunks - 1) % p.pp if p.pp_schedule != "ZBVZeroBubble" else 0
    if pp_rank == last_rank:
        h = head_pass(cfg, spec, micro, dtype=dtype, e=e)
        fwd += h.forward
        bwd += h.backward
        gemm += h.fwd_gemm + h.bwd_gemm
    k = 1.0 / spec.in_step_efficiency  # kernels inside a training step run slower than in isolation
    return _Stage(fwd * k, (bwd + recompute) * k, recompute * k, attention * k, gemm * k, len(owned))


def bubble_fraction(cfg: RootConfig, n_micro: int) -> float:
    """Idle time of a pipeline relative to its compute time (0 without PP)."""
    p = cfg.parallelism
    if p.pp == 1:
        return 0.0
    v = p.pp_virtual_stages if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") else 1
    bubble = (p.pp - 1) / (v * n_micro)
    if p.pp_schedule in ZERO_BUBBLE_SCHEDULES:
        bubble *= ZERO_BUBBLE_FACTOR
    return bubble


def _dp_exposed(
    cfg: RootConfig, groups: Dict[str, Group], stage: _Stage, precision: str, n_micro: int, grad_accum: int
) -> Tuple[float, float]:
    """(exposed, total) seconds of the data-parallel collectives of one step on pipeline rank 0's shard."""
    p = cfg.parallelism
    dt = dtypes_for(cfg, precision)
    st = state_bytes(cfg, precision)
    layers = max(1, stage.layers)
    shard_group = _fsdp_group(cfg, groups)
    exposed = total = 0.0
    if fsdp_degree(p) > 1:
        full = st.stage_numel_unsharded
        ag = shard_group.all_gather(full * dt.fsdp_param)
        rs = shard_group.reduce_scatter(full * dt.fsdp_reduce)
        micro_steps = n_micro if p.pp > 1 else grad_accum
        per_step_rs = 1 if (fsdp_grad_sync_mode(p) == "last_microbatch" or micro_steps == 1) else micro_steps
        ag_bwd = ag if p.reshard_after_forward else 0.0
        fwd_exposed = max(0.0, ag - stage.forward) + ag / layers
        bwd_comm = ag_bwd + rs * (per_step_rs / micro_steps)
        bwd_exposed = max(0.0, bwd_comm - stage.backward) + rs / layers * (per_step_rs / micro_steps)
        # each micro batch gathers in forward (again in backward when reshard_after_forward dropped the blocks),
        # except that reshard_after_forward=false with deferred sync keeps them gathered from the first forward to
        # the last backward (parallel/data_parallel.set_fsdp_gradient_sync): one gather per step
        keep_gathered = not p.reshard_after_forward and fsdp_grad_sync_mode(p) == "last_microbatch"
        gathers = 1 if keep_gathered else micro_steps
        exposed += gathers * fwd_exposed + micro_steps * bwd_exposed
        total += gathers * ag + micro_steps * ag_bwd + per_step_rs * rs
        if p.dp_replicate > 1:
            ar = groups["dp_replicate"].all_reduce(st.numel * dt.fsdp_reduce)
            total += ar
            exposed += max(0.0, ar - stage.backward) + ar / layers
    elif p.dp_replicate > 1:
        grads = st.numel * 4 if precision == "bf16-mixed" else st.numel * dt.param
        ar = groups["dp_replicate"].all_reduce(grads)
        total += ar
        if p.overlap_grad_reduce:
            buckets = max(1, math.ceil(grads / (p.ddp_bucket_cap_mb * 1e6)))
            exposed += max(0.0, ar - stage.backward) + ar / buckets
        else:
            exposed += ar
    return exposed, total


def _fsdp_group(cfg: RootConfig, groups: Dict[str, Group]) -> Group:
    """FSDP shards over dp_shard x cp: the slower of the two placements, at the product size."""
    p = cfg.parallelism
    g = groups["dp_shard"]
    if p.cp > 1:
        c = groups["cp"]
        slow = g if g.bus_gbps <= c.bus_gbps else c
        return Group(
            "dp_shard x cp",
            p.dp_shard * p.cp,
            g.crosses_nodes or c.crosses_nodes,
            slow.bus_gbps,
            slow.latency_s,
            slow.measured,
        )
    return g


def predict_step(
    cfg: RootConfig, batch: BatchPlan, precision: str, spec: DeviceSpec, links: Links, *, cp_bytes: int, ep_bytes: int
) -> StepTime:
    """The step of ``cfg`` (validated) on devices ``spec`` over ``links``. ``cp_bytes`` / ``ep_bytes``: the K/V
    exchange and expert all-to-all bytes one rank sends per step (``planner.cp_exchange_bytes`` and
    ``planner.ep_all_to_all_bytes``)."""
    p, m = cfg.parallelism, cfg.model
    dt = dtypes_for(cfg, precision)
    micro = batch.micro_batch_size
    n_micro = p.pp_microbatches or batch.grad_accum
    if p.pp > 1:
        micro = batch.micro_batch_size * batch.grad_accum // n_micro
    names = [d for d in MESH_ORDER if getattr(p, d) > 1] + (["ep"] if p.ep > 1 else [])
    groups = {d: mesh_group(cfg, links, d) for d in (*MESH_ORDER, "ep")}
    stages = [stage_time(cfg, spec, micro, precision, r) for r in range(p.pp)]
    slow = max(stages, key=lambda s: s.forward + s.backward)
    per_micro = slow.forward + slow.backward
    compute = n_micro * per_micro
    recompute = n_micro * slow.recompute
    bubble = bubble_fraction(cfg, n_micro) * compute

    tp_comm = 0.0
    if p.tp > 1:
        activations = micro * m.seq_len // p.cp * m.d_model * dt.compute
        per_block = 4 + (2 if p.activation_checkpointing == "full" else 0)
        tp_comm = n_micro * slow.layers * per_block * groups["tp"].all_reduce(activations)

    pp_comm = 0.0
    if p.pp > 1:
        pg = groups["pp"]
        link = links.inter if pg.crosses_nodes and _pp_stride(cfg) >= links.gpus_per_node else links.intra
        sent = micro * m.seq_len // p.cp * m.d_model * dt.compute // (p.tp if p.sequence_parallel else 1)
        pp_comm = 2 * n_micro * p.pp_virtual_stages * pg.send(sent, link.bus_gbps)

    dp_exposed, dp_total = _dp_exposed(cfg, groups, slow, precision, n_micro, batch.grad_accum)

    cp_comm = 0.0
    if p.cp > 1:
        cp_time = cp_bytes / (groups["cp"].bus_gbps * 1e9)
        cp_comm = max(0.0, cp_time - n_micro * slow.attention)
    ep_comm = groups["ep"].all_to_all(ep_bytes * p.ep / max(1, p.ep - 1)) if p.ep > 1 else 0.0

    st = state_bytes(cfg, precision)
    optimizer = memory_time(spec, st.numel * dt.param * OPTIMIZER_BYTES_PER_PARAM_BYTE) + spec.kernel_overhead_s * 4
    device_s = compute + bubble + tp_comm + pp_comm + dp_exposed + cp_comm + ep_comm + optimizer
    host = host_time(cfg, spec, micro, n_micro, slow.layers, device_s)
    share = (slow.gemm / per_micro) if per_micro > 0 else 0.0
    return StepTime(
        compute_s=compute,
        recompute_s=recompute,
        tp_comm_s=tp_comm,
        pp_bubble_s=bubble,
        pp_comm_s=pp_comm,
        dp_comm_s=dp_exposed,
        dp_comm_total_s=dp_total,
        cp_comm_s=cp_comm,
        ep_comm_s=ep_comm,
        optimizer_s=optimizer,
        host_s=host,
        groups=[groups[d] for d in names],
        gemm_share=share,
    )


# At most this many ops per block and per head (forward + backward; ``host_overhead`` counts 206-277 per block and
# 56-633 for embedding, head and loss on the presets): below ``device_s`` the host is hidden and nothing is counted.
MAX_OPS_PER_BLOCK, MAX_OPS_HEAD = 400, 1000


def host_time(cfg: RootConfig, spec: DeviceSpec, micro: int, n_micro: int, layers: int, device_s: float) -> float:
    """Host dispatch of one step's ops on the busiest rank (``host_overhead``): all of it where the host waits
    for each op (CPU), what exceeds the device's work where it runs ahead (GPU)."""
    if spec.op_overhead_s <= 0:
        return 0.0
    bound = (n_micro * (layers * MAX_OPS_PER_BLOCK + MAX_OPS_HEAD) + 1000) * spec.op_overhead_s
    if spec.host_async and bound <= device_s:
        return 0.0
    # deferred: counting builds the model on the meta device, only where the host time can show
    from lmforge.parallel.host_overhead import OPTIMIZER_OPS, ops_per_micro_batch

    block, rest = ops_per_micro_batch(cfg, micro)
    ops = n_micro * (layers * block + rest) + OPTIMIZER_OPS
    host = ops * spec.op_overhead_s
    return max(0.0, host - device_s) if spec.host_async else host


def _pp_stride(cfg: RootConfig) -> int:
    p = cfg.parallelism
    return p.dp_replicate * p.dp_shard * p.cp * p.tp


def links_for(cfg: RootConfig, spec: DeviceSpec) -> Links:
    """The links of ``cfg.cluster`` (``auto``: the device's NVLink and NIC), measured curves when given."""
    c = cfg.cluster
    intra = link_spec(spec.intra_link if c.intra_node_link == "auto" else c.intra_node_link)
    inter = link_spec(spec.inter_link if c.inter_node_link == "auto" else c.inter_node_link)
    measured_intra = measured_inter = None
    if c.comm_bench:
        world, curve = bench_bandwidth(c.comm_bench)
        if world <= c.gpus_per_node:
            measured_intra = curve
        else:
            measured_inter = curve
    return Links(intra, inter, c.gpus_per_node, measured_intra, measured_inter)

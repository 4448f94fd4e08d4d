"""Memory per device of a training layout, estimated from the config alone (no device, no weights).

Model state (parameters, gradients, AdamW state) is counted *exactly*: the GPT is built on the meta
device (shapes only, no memory) and every parameter is split the way the engine splits it:

- pipeline: layers are cut into ``pp * pp_virtual_stages`` chunks of ``parallelism.pp_layers[c]`` consecutive
  blocks (equal chunks when unset); chunk ``c`` lives on pipeline
  rank ``c % pp`` (looped schedules) or, for the V-shaped ``ZBVZeroBubble``, on ``c`` / ``2*pp-1-c``.
  The first chunk's rank holds the embedding, the last chunk's rank the final norm and the output
  projection (tied embeddings with pp > 1 are refused by ``config/validate.py``).
- tensor parallel (torchtitan's plan): ``wq/wk/wv/w1/w3`` and the embedding/output rows are split on
  dim 0, ``wo/w2`` on dim 1, norms are replicated.
- FSDP2 splits dim 0 of each (TP-local) tensor over ``dp_shard`` with ``torch.chunk`` semantics: every
  rank but the last holds ``ceil(n / dp_shard)`` rows, which is also the padded size FSDP2 allocates.

Activations are counted per micro batch from the table of tensors one block saves for backward
(``parallel/activation_table.py``: one row per tensor, elements per token, dtype, whether tp / sp divide it;
``tests/unit/test_activation_table.py`` checks it against the storages a meta-device block saves, and
``tests/unit/test_planner_activations.py`` against torch.profiler):

    per layer, no checkpointing  (N tokens, d = d_model, F = FFN width, E compute / R residual bytes)
      2 norms:        input (R), fp32 statistics, output = the linears' input (E)       (/tp under sp)
      attention:      q, k (after RoPE), v at n_kv heads, SDPA output (E), fp32 log-sum-exp     (/tp)
      MLP:            SwiGLU w1 out, silu out, w3 out, product; GELU w1 out, gelu out (E)       (/tp)
      16-bit GELU/LayerNorm/MHA block: 32*N*d bytes + statistics (Korthikanti et al. 2022 less dropout)
    full checkpointing:     the block input only, plus one block's activations while it is recomputed
    selective:              block input + outputs of every matmul and of SDPA (element-wise ops recomputed);
                            selective_matmuls=alternate: of the odd matmuls only (wq, wv, w1, w2 of SwiGLU)
    head (last stage):      final norm's rows + its output and the logits N * vocab in the compute dtype (all
                            that model/loss.py's chunked cross-entropy keeps; N * vocab/tp under loss
                            parallelism); their gradient, the same size, exists transiently at the start of
                            backward.

With tensor parallelism the head/FFN-inner tensors are split by ``tp``; with sequence parallelism every row of
the block is (the linears keep their input's sequence shard: ``tensor_parallel.SequenceGatheredInput``).
Micro batches alive at once on a pipeline rank: 1 without PP; ``pp - rank`` for 1F1B and the zero-bubble
schedules (ZB-H1 keeps 1F1B's memory); all of them for GPipe; ``pp * (1 + (pp-1)/(pp*v))`` stage-units
for Interleaved1F1B (Narayanan et al., 2021).

FSDP2 working memory: with ``reshard_after_forward`` two blocks' parameters are gathered at a time
(current + prefetched) and two blocks' unsharded gradients wait for reduce-scatter; without it every
block stays gathered from forward to backward. The root module (embedding, final norm, output) stays
gathered. With ``fsdp_grad_sync=last_microbatch`` (and always under pipelining) and more than one micro batch,
every block's unsharded gradient (reduce dtype) is kept from the first micro batch's backward until the
reduce-scatter after the last one, instead of two blocks' in flight; without ``reshard_after_forward`` the blocks
then stay gathered from the step's first forward to its last backward (the ``distributed_optimizer`` preset:
Megatron's distributed optimizer). ``fsdp_working_bytes`` counts both. ``bf16-mixed`` autocast caches a bf16 copy of every matmul weight during forward.
``fp8`` plans its activations as ``bf16-mixed``'s (torchao's ``Float8Linear`` keeps its bf16 input, not a float8
one: ``activation_table.py``); its float8 weight casts are transient and not cached.

Expert parallelism (``parallelism.ep``): the routed experts' weights [E, ...] are split E/ep over the ep ranks and
FSDP-sharded over the dp_shard / ep ranks holding the same experts (replicated over dp_replicate) (parallel/expert_parallel.py).

Context parallelism (``parallelism.cp``): a rank holds N/cp tokens of every micro batch, so every activation
term above is divided by cp; FSDP shards over dp_shard x cp; the all-gather exchange additionally keeps the
other ranks' K/V (2 * N * (cp-1)/cp * n_kv_heads * head_dim per layer, /tp: K/V are exchanged at their own
heads), the ring one received K/V block and one fp32 dK/dV block at a time (transient).
"""

from __future__ import annotations

import functools
import json
import math
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from lmforge.config.batch import BatchPlan
from lmforge.config.model import ModelConfig
from lmforge.config.parallelism import chunk_layers, chunk_of_layer, fsdp_grad_sync_mode
from lmforge.config.schema import RootConfig
from lmforge.model.gpt import GPT, kv_heads
from lmforge.parallel.activation_table import (
    BlockPrecision,
    block_input,
    block_saved_tensors,
    modules_saved_tensors,
    selective_saved_tensors,
    table_bytes,
)

GIB = 1024**3
ADAMW_STATES = 2  # exp_avg and exp_avg_sq, same shape and dtype as the parameter
ADAMW_STEP_BYTES = 4  # one fp32 ``step`` tensor per parameter
COLWISE = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "feed_forward.w1.weight",
    "feed_forward.w3.weight",
)
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")
VOCAB_SHARDED = ("tok_embeddings.weight", "output.weight")
AC_MODES = ("none", "selective", "full")


def dtype_bytes(name: str) -> int:
    return 2 if name in ("bf16", "fp16") else 4


def resolve_precision(precision: str, device_kind: str) -> str:
    """``train.precision=auto`` means bf16-mixed on GPUs and fp32 on CPU (as the engine resolves it)."""
    if precision == "auto":
        return "fp32" if device_kind == "cpu" else "bf16-mixed"
    return precision


@dataclass(frozen=True)
class Dtypes:
    param: int  # bytes per parameter / gradient / AdamW state element
    compute: int  # activations inside blocks
    residual: int  # residual stream (norm inputs)
    fsdp_param: int  # FSDP2 all-gathered parameters
    fsdp_reduce: int  # FSDP2 unsharded gradients before reduce-scatter


def dtypes_for(cfg: RootConfig, precision: str) -> Dtypes:
    p = cfg.parallelism
    param = 2 if precision == "bf16" else 4
    fsdp_bf16 = fsdp_degree(p) > 1 and p.param_dtype == "bf16"
    # fp8 computes outside its float8 GEMMs in bf16 under autocast, and its linears' outputs are bf16
    compute = 2 if (precision in ("bf16", "bf16-mixed", "fp8") or fsdp_bf16) else 4
    # bf16-mixed / fp8: a bf16 residual stream unless train.fp32_residual (refused with FSDP bf16 parameters)
    mixed = precision in ("bf16-mixed", "fp8")
    residual = 4 if (mixed and cfg.train.fp32_residual and not fsdp_bf16) else compute
    fsdp_param = dtype_bytes(p.param_dtype) if precision != "bf16" else 2
    fsdp_reduce = dtype_bytes(p.reduce_dtype) if precision != "bf16" else 2
    return Dtypes(param, compute, residual, fsdp_param, fsdp_reduce)


@functools.lru_cache(maxsize=32)
def _shapes(model_json: str) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    import torch

    items = json.loads(model_json)
    with torch.device("meta"):
        model = GPT(ModelConfig(**items))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def parameter_shapes(model: ModelConfig) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """(name, shape) of every parameter of the single-device model, from a meta-device build."""
    return _shapes(json.dumps(asdict(model), sort_keys=True))  # JSON: hashable with the nested model.moe


def chunk_size(n: int, parts: int, index: int) -> int:
    """Length of piece ``index`` when ``torch.chunk`` splits ``n`` into ``parts`` (FSDP2/DTensor sharding)."""
    step = -(-n // parts)
    return max(0, min(step, n - index * step))


def chunk_owner(chunk: int, pp: int, schedule: str) -> int:
    """Pipeline rank holding model chunk ``chunk`` (of ``pp * virtual`` chunks)."""
    if schedule == "ZBVZeroBubble":
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def layer_owner(cfg: RootConfig, layer: int) -> int:
    """Pipeline rank holding block ``layer``: the chunk holding it (``parallelism.pp_layers``, or the even split:
    ``config/parallelism.chunk_of_layer``, as ``parallel/pipeline.plan_stages`` builds them), placed by
    :func:`chunk_owner`."""
    p = cfg.parallelism
    return chunk_owner(chunk_of_layer(p, cfg.model.n_layers, layer), p.pp, p.pp_schedule)


def layer_owners(cfg: RootConfig) -> List[int]:
    """:func:`layer_owner` of every block, in block order, from one pass over the stage map."""
    p = cfg.parallelism
    owners: List[int] = []
    for chunk, count in enumerate(chunk_layers(p, cfg.model.n_layers)):
        owners += [chunk_owner(chunk, p.pp, p.pp_schedule)] * count
    return owners


def checkpointed_blocks(cfg: RootConfig, pp_rank: int) -> int:
    """Blocks on pipeline rank ``pp_rank`` that activation checkpointing applies to: the first
    ``parallelism.recompute_layers`` of each of its chunks (``parallel/activation_checkpoint.chosen_blocks``),
    all of them for 0."""
    p = cfg.parallelism
    counts = chunk_layers(p, cfg.model.n_layers)
    mine = [n for c, n in enumerate(counts) if chunk_owner(c, p.pp, p.pp_schedule) == pp_rank]
    return sum(n if p.recompute_layers == 0 else min(n, p.recompute_layers) for n in mine)


@dataclass
class StateBytes:
    """Model state on one rank: bytes of parameters, gradients and AdamW state, and tensor counts."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    numel: int = 0
    tensors: int = 0
    layers: int = 0
    max_layer_numel: int = 0  # TP-local, FSDP-unsharded numel of the largest block (FSDP gathers it)
    stage_numel_unsharded: int = 0  # TP-local, FSDP-unsharded numel of everything on this pipeline rank
    root_numel_unsharded: int = 0  # embedding/norm/output on this rank (FSDP root stays gathered)
    matmul_numel_unsharded: int = 0  # matmul weights on this rank (bf16 autocast copies)
    expert_numel: int = 0  # routed experts' parameters on this rank (E/ep experts, FSDP-sharded)
    first: bool = False  # holds the embedding
    last: bool = False  # holds the final norm and output

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(
    cfg: RootConfig, precision: str, pp_rank: int = 0, tp_rank: int = 0, dp_shard_rank: int = 0
) -> StateBytes:
    """Exact parameter, gradient and AdamW bytes held by the rank at these mesh coordinates."""
    if tp_rank == 0 and dp_shard_rank == 0:
        return stage_states(cfg, precision)[pp_rank]
    return _count_state(cfg, precision, _held_by_rank(cfg).get(pp_rank, []), pp_rank, tp_rank, dp_shard_rank)


_STATE_CACHE: "OrderedDict[tuple, Tuple[StateBytes, ...]]" = OrderedDict()
STATE_CACHE_SIZE = 1024


def _state_key(cfg: RootConfig, precision: str) -> tuple:
    """Everything the state of a pipeline rank depends on: the model, the layout fields that place and shard the
    parameters (the stage map, tp, ep, the FSDP degree), and what ``dtypes_for`` reads."""
    p = cfg.parallelism
    stage_map = tuple(p.pp_layers) if p.pp_layers is not None else None
    layout = (p.tp, p.pp, p.pp_schedule, p.pp_virtual_stages, stage_map, p.ep, p.dp_shard, p.cp)
    dtypes = (p.param_dtype, p.reduce_dtype, precision, cfg.train.fp32_residual)
    return (repr(cfg.model), layout, dtypes)


def stage_states(cfg: RootConfig, precision: str) -> List[StateBytes]:
    """``state_bytes`` of every pipeline rank (tp and dp_shard rank 0), from one pass over the parameters and
    kept for the next layout that places and shards them alike (``lmforge plan --search`` varies the micro batch
    and the checkpointing of one layout)."""
    key = _state_key(cfg, precision)
    states = _STATE_CACHE.get(key)
    if states is None:
        held = _held_by_rank(cfg)
        states = tuple(_count_state(cfg, precision, held.get(r, []), r) for r in range(cfg.parallelism.pp))
        _STATE_CACHE[key] = states
        if len(_STATE_CACHE) > STATE_CACHE_SIZE:
            _STATE_CACHE.popitem(last=False)
    return [replace(st) for st in states]


def _held_by_rank(cfg: RootConfig) -> Dict[int, List[Tuple[str, Tuple[int, ...]]]]:
    """(name, shape) of the parameters each pipeline rank holds: its blocks, the embedding on the rank of the first
    chunk, the final norm and the output on the rank of the last."""
    m, p = cfg.model, cfg.parallelism
    chunks = len(chunk_layers(p, m.n_layers))
    first_rank = chunk_owner(0, p.pp, p.pp_schedule)
    last_rank = chunk_owner(chunks - 1, p.pp, p.pp_schedule)
    owners = layer_owners(cfg)
    held: Dict[int, List[Tuple[str, Tuple[int, ...]]]] = {}
    for name, shape in parameter_shapes(m):
        if name.startswith("layers."):
            rank = owners[int(name.split(".")[1])]
        elif name.startswith("tok_embeddings."):
            rank = first_rank
        elif name.startswith(("norm.", "output.")):
            rank = last_rank
        else:
            continue
        held.setdefault(rank, []).append((name, shape))
    return held


def _count_state(
    cfg: RootConfig,
    precision: str,
    held: List[Tuple[str, Tuple[int, ...]]],
    pp_rank: int,
    tp_rank: int = 0,
    dp_shard_rank: int = 0,
) -> StateBytes:
    """The bytes of the parameters ``held`` by the rank at these mesh coordinates."""
    m, p = cfg.model, cfg.parallelism
    dt = dtypes_for(cfg, precision)
    chunks = len(chunk_layers(p, m.n_layers))
    first_rank = chunk_owner(0, p.pp, p.pp_schedule)
    last_rank = chunk_owner(chunks - 1, p.pp, p.pp_schedule)
    out = StateBytes(first=pp_rank == first_rank, last=pp_rank == last_rank)
    layer_numel: Dict[int, int] = {}

    def local(name: str, shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], int]:
        shape = list(shape)
        if p.ep > 1 and ".feed_forward.experts." in name:  # E/ep experts, FSDP over the dp ranks holding the same
            shape[0] = chunk_size(shape[0], p.ep, 0)
            ep_numel = math.prod(shape)
            shape[0] = chunk_size(shape[0], p.dp_shard // p.ep, 0)
            return tuple(shape), ep_numel
        if p.tp > 1:
            if name.endswith(COLWISE) or name.endswith(VOCAB_SHARDED):
                shape[0] = chunk_size(shape[0], p.tp, tp_rank)
            elif name.endswith(ROWWISE):
                shape[1] = chunk_size(shape[1], p.tp, tp_rank)
        tp_numel = math.prod(shape)
        if fsdp_degree(p) > 1:  # FSDP shards over dp_shard x cp (cp ranks hold replicas)
            shape[0] = chunk_size(shape[0], fsdp_degree(p), dp_shard_rank)
        return tuple(shape), tp_numel

    for name, shape in held:
        shard, tp_numel = local(name, shape)
        n = math.prod(shard)
        out.numel += n
        if ".feed_forward.experts." in name:
            out.expert_numel += n
        out.tensors += 1
        out.stage_numel_unsharded += tp_numel
        if len(shape) == 2:
            out.matmul_numel_unsharded += tp_numel
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            layer_numel[layer] = layer_numel.get(layer, 0) + tp_numel
        else:
            out.root_numel_unsharded += tp_numel
    out.layers = len(layer_numel)
    out.max_layer_numel = max(layer_numel.values(), default=0)
    out.params = out.numel * dt.param
    out.grads = out.numel * dt.param
    out.optimizer = out.numel * dt.param * ADAMW_STATES + out.tensors * ADAMW_STEP_BYTES
    return out


@dataclass(frozen=True)
class ActivationShape:
    tokens: int  # N = micro_batch_size * seq_len / cp (a cp rank's share of each sequence)
    tp: int
    sp: bool
    dt: Dtypes
    gathered_kv_tokens: int = 0  # cp all-gather: other ranks' tokens whose K/V each block keeps for backward
    positions: int = 0  # sequence positions per micro batch on this rank (seq_len / cp); 0: as many as tokens
    autocast: bool = False  # bf16 autocast: norms in fp32, each linear casts its own input
    float8: bool = False  # train.precision=fp8: torchao Float8Linear in the blocks (activation_table.py)
    rms_norm_kernel: str = "fused"  # CUDA's fused RMSNorm; "composite" on CPU (activation_table.RMS_NORM_KERNELS)
    loss_parallel: bool = False  # tp > 1 and parallelism.loss_parallel: the logits stay vocab-sharded (V/tp a rank)


def block_precision(s: ActivationShape) -> BlockPrecision:
    return BlockPrecision(residual=s.dt.residual, compute=s.dt.compute, autocast=s.autocast, float8=s.float8)


def _rows_bytes(rows, s: ActivationShape) -> int:
    return table_bytes(rows, tokens=s.tokens, positions=s.positions or s.tokens, tp=s.tp, sp=s.sp)


def layer_activation_bytes(
    m: ModelConfig, s: ActivationShape, mode: str, modules: Sequence[str] = (), matmuls: str = "all"
) -> int:
    """Bytes one block keeps for backward for one micro batch, under checkpointing ``mode``: the rows of
    ``parallel/activation_table.py`` (``none``: every tensor the block saves; ``selective``: the block input and
    the SDPA and matmul outputs, every matmul's or the odd ones' (``matmuls``); ``full``: the block input;
    ``modules``: every tensor less those of the recomputed ``modules``), plus the other cp ranks' K/V under the
    cp all-gather."""
    p = block_precision(s)
    kept = _rows_bytes((block_input(m, p),), s)
    if mode == "full":
        return kept
    gathered_kv = 2 * s.gathered_kv_tokens * kv_heads(m) * (m.d_model // m.n_heads) * s.dt.compute // s.tp
    if mode == "selective":
        return kept + _rows_bytes(selective_saved_tensors(m, p, matmuls), s) + gathered_kv
    rows = block_saved_tensors(m, p, sp=s.sp, rms_norm_kernel=s.rms_norm_kernel)
    if mode == "modules":
        rows = modules_saved_tensors(rows, tuple(modules))
    return _rows_bytes(rows, s) + gathered_kv


def head_activation_bytes(m: ModelConfig, s: ActivationShape) -> int:
    """Final norm (its rows of the block table, on the sequence shard under sp), its output (the head's input:
    gathered to the full sequence) and the logits, compute dtype, kept by the last stage for one micro batch."""
    norm = tuple(
        r
        for r in block_saved_tensors(m, block_precision(s), rms_norm_kernel=s.rms_norm_kernel)
        if r.name.startswith("attention_norm.") and r.name != "attention_norm.output"
    )
    n = s.tokens
    return _rows_bytes(norm, s) + n * m.d_model * s.dt.compute + n * logit_columns(m, s) * s.dt.compute


def logit_columns(m: ModelConfig, s: ActivationShape) -> int:
    """Columns of the logits a rank holds: its vocabulary shard under loss parallelism (``loss_parallel.py``),
    else the whole vocabulary (gathered over tp)."""
    return chunk_size(m.vocab_size, s.tp, 0) if s.loss_parallel else m.vocab_size


def saved_activation_bytes(
    m: ModelConfig,
    s: ActivationShape,
    mode: str,
    layers: int,
    first: bool = True,
    last: bool = True,
    *,
    modules: Sequence[str] = (),
    checkpointed: Optional[int] = None,
    matmuls: str = "all",
    per_block: Optional[int] = None,
) -> int:
    """Bytes a stage of ``layers`` blocks keeps for backward at the end of one micro batch's forward;
    ``checkpointed``: how many of them ``mode`` applies to (``parallelism.recompute_layers``; None: all), the rest
    keep everything; ``matmuls``: the matmul outputs ``selective`` keeps (``parallelism.selective_matmuls``);
    ``per_block``: ``layer_activation_bytes`` of ``mode`` when the caller has it."""
    n_ck = layers if checkpointed is None else min(layers, checkpointed)
    if per_block is None:
        per_block = layer_activation_bytes(m, s, mode, modules, matmuls)
    kept = n_ck * per_block
    if n_ck < layers:
        kept += (layers - n_ck) * layer_activation_bytes(m, s, "none")
    if last:
        kept += head_activation_bytes(m, s)
    if first:
        kept += s.tokens * 8  # token ids kept by the embedding
    return kept


def activation_shape(
    cfg: RootConfig, micro_batch_size: int, precision: str, rms_norm_kernel: str = "fused"
) -> ActivationShape:
    """The activation layout of one micro batch on one rank; ``rms_norm_kernel="composite"`` for CPU runs."""
    p = cfg.parallelism
    local = micro_batch_size * cfg.model.seq_len // p.cp
    gathered = local * (p.cp - 1) if p.cp > 1 and p.cp_kv_exchange == "allgather" else 0
    autocast = precision in ("bf16-mixed", "fp8") and not (fsdp_degree(p) > 1 and p.param_dtype == "bf16")
    return ActivationShape(
        tokens=local,
        tp=p.tp,
        sp=p.sequence_parallel,
        dt=dtypes_for(cfg, precision),
        gathered_kv_tokens=gathered,
        positions=cfg.model.seq_len // p.cp,
        autocast=autocast,
        float8=precision == "fp8",
        rms_norm_kernel=rms_norm_kernel,
        loss_parallel=p.loss_parallel and p.tp > 1,
    )


def fsdp_degree(p) -> int:
    """Ranks FSDP shards over: dp_shard, times cp (cp ranks hold replicas; parallel/data_parallel.py)."""
    return p.dp_shard * p.cp


def cp_ring_buffer_bytes(cfg: RootConfig, shape: ActivationShape) -> int:
    """The ring's blocks in flight (one layer at a time): a received K/V block and, in backward, a received fp32
    dK/dV accumulator, at the K/V heads (n_kv_heads * head_dim features per token: exchanged before the GQA
    expansion)."""
    p, m = cfg.parallelism, cfg.model
    if p.cp == 1 or p.cp_kv_exchange != "ring":
        return 0
    return 2 * shape.tokens * kv_heads(m) * (m.d_model // m.n_heads) * (shape.dt.compute + 4) // p.tp


def head_microbatches_in_flight(cfg: RootConfig, n_micro: int) -> int:
    """Micro batches whose head activations (logits, final norm) the last stage holds at once: the head sits in
    the model's last chunk, which under every 1F1B-family schedule (1F1B, the zero-bubble ones, Interleaved1F1B)
    runs each micro batch's backward right after its forward (Narayanan et al., 2021, Fig. 4: the last stage
    has no warm-up forwards), so one; GPipe runs every forward first, so all of them. Counting the head at
    :func:`microbatches_in_flight` instead would charge an interleaved last rank its ``pp * (1 + ...)``
    stage-units of logits, though only its other chunk's blocks wait that long."""
    p = cfg.parallelism
    return n_micro if (p.pp > 1 and p.pp_schedule == "GPipe") else 1


def microbatches_in_flight(cfg: RootConfig, n_micro: int, pp_rank: int) -> float:
    """Micro batches whose activations one pipeline rank holds at its peak (in units of its layers)."""
    p = cfg.parallelism
    if p.pp == 1:
        return 1.0
    if p.pp_schedule == "GPipe":
        return float(n_micro)
    if p.pp_schedule == "Interleaved1F1B":
        v = p.pp_virtual_stages
        return min(float(n_micro), p.pp * (1 + (p.pp - 1) / (p.pp * v)))
    return float(min(n_micro, p.pp - pp_rank))


@dataclass
class MemoryEstimate:
    """Bytes on the most loaded device; ``activations_by_mode`` shows the checkpointing alternatives."""

    pp_rank: int
    state: StateBytes
    activations: int
    activations_by_mode: Dict[str, int]
    fsdp_buffers: int
    autocast_copies: int
    transient: int  # logits at the end of forward, DDP flat buffer without overlap
    dtypes: Dtypes
    per_stage_total: Dict[int, int] = field(default_factory=dict)
    fsdp_unsharded_grads: int = 0  # the part of fsdp_buffers holding unsharded gradients before reduce-scatter
    fsdp_gathered_params: int = 0  # the rest of fsdp_buffers: gathered parameters (param_dtype)

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.fsdp_buffers + self.autocast_copies + self.transient

    def total_with(self, mode: str) -> int:
        return self.total - self.activations + self.activations_by_mode[mode]


def fsdp_working_bytes(cfg: RootConfig, st: StateBytes, dt: Dtypes, micro_batches: int) -> Tuple[int, int]:
    """FSDP2's gathered parameters (``param_dtype``) and unsharded gradients (``reduce_dtype``) on a pipeline rank
    at its peak, the start of a backward, for a step of ``micro_batches`` micro batches: (params, grads) bytes.

    Parameters: the root (embedding, final norm, output) stays gathered; blocks two at a time (current +
    prefetched) with ``reshard_after_forward``, else every block of the stage (kept from forward to backward, and
    under deferred sync from the step's first forward to its last backward). Gradients: two blocks' and the
    root's before their reduce-scatter, or, deferred over more than one micro batch, every block's. With tp > 1
    the embedding's unsharded gradient is the whole vocab x d table (DTensor's embedding backward returns it
    Replicate; ``keep_grads_in_param_layout`` slices only the sharded parameters' gradients)."""
    p, m = cfg.parallelism, cfg.model
    if fsdp_degree(p) == 1:
        return 0, 0
    blocks = st.stage_numel_unsharded - st.root_numel_unsharded
    gathered = 2 * st.max_layer_numel if p.reshard_after_forward else blocks
    unsharded_grads = 2 * st.max_layer_numel + st.root_numel_unsharded
    if fsdp_grad_sync_mode(p) == "last_microbatch" and micro_batches > 1:
        unsharded_grads = st.stage_numel_unsharded  # every block's full gradient waits for the last micro batch
    if p.tp > 1 and st.first:  # the replicated table's rows beyond this tp rank's
        unsharded_grads += (m.vocab_size - chunk_size(m.vocab_size, p.tp, 0)) * m.d_model
    return (gathered + st.root_numel_unsharded) * dt.fsdp_param, unsharded_grads * dt.fsdp_reduce


def _stage_estimate(
    cfg: RootConfig,
    plan: BatchPlan,
    precision: str,
    pp_rank: int,
    states: List[StateBytes],
    per_block: Dict[str, int],
) -> MemoryEstimate:
    """``per_block``: ``layer_activation_bytes`` of each mode for this micro batch (the same on every rank)."""
    m, p = cfg.model, cfg.parallelism
    dt = dtypes_for(cfg, precision)
    st = states[pp_rank]
    n_micro = p.pp_microbatches or plan.grad_accum
    shape = activation_shape(cfg, plan.micro_batch_size, precision)
    in_flight = microbatches_in_flight(cfg, n_micro, pp_rank)
    head = head_activation_bytes(m, shape) * head_microbatches_in_flight(cfg, n_micro) if st.last else 0
    by_mode = {}
    for mode in AC_MODES:
        kept = saved_activation_bytes(m, shape, mode, st.layers, st.first, last=False, per_block=per_block[mode])
        working = per_block["none"] if mode != "none" else 0  # one block recomputed
        by_mode[mode] = int(math.ceil(in_flight * kept)) + head + working
    configured = by_mode.get(p.activation_checkpointing)
    if p.activation_checkpointing == "modules" or p.recompute_layers > 0:  # the configured recompute, exactly
        kept = saved_activation_bytes(
            m,
            shape,
            p.activation_checkpointing,
            st.layers,
            st.first,
            last=False,
            modules=p.recompute_modules,
            checkpointed=checkpointed_blocks(cfg, pp_rank),
            matmuls=p.selective_matmuls,
        )
        working = layer_activation_bytes(m, shape, "none") if p.activation_checkpointing != "none" else 0
        configured = int(math.ceil(in_flight * kept)) + head + working
        if p.activation_checkpointing == "modules":
            by_mode["modules"] = configured
    fsdp_params, fsdp_grads = fsdp_working_bytes(cfg, st, dt, n_micro if p.pp > 1 else plan.grad_accum)
    fsdp = fsdp_params + fsdp_grads
    autocast = (
        st.matmul_numel_unsharded * 2
        if precision == "bf16-mixed" and not (fsdp_degree(p) > 1 and p.param_dtype == "bf16")
        else 0
    )
    transient = shape.tokens * logit_columns(m, shape) * dt.compute if st.last else 0  # the logits' gradient
    transient += cp_ring_buffer_bytes(cfg, shape)
    if p.dp_replicate > 1 and fsdp_degree(p) == 1 and not p.overlap_grad_reduce:
        transient += st.grads  # the flat all-reduce buffer
    return MemoryEstimate(
        pp_rank,
        st,
        configured,
        by_mode,
        fsdp,
        autocast,
        transient,
        dt,
        fsdp_unsharded_grads=fsdp_grads,
        fsdp_gathered_params=fsdp_params,
    )


def estimate_memory(cfg: RootConfig, plan: BatchPlan, precision: str) -> MemoryEstimate:
    """The most loaded pipeline rank's estimate (every rank of the other dims is at most as loaded)."""
    states = stage_states(cfg, precision)
    shape = activation_shape(cfg, plan.micro_batch_size, precision)
    matmuls = cfg.parallelism.selective_matmuls
    per_block = {mode: layer_activation_bytes(cfg.model, shape, mode, matmuls=matmuls) for mode in AC_MODES}
    stages = [_stage_estimate(cfg, plan, precision, r, states, per_block) for r in range(cfg.parallelism.pp)]
    worst = max(stages, key=lambda s: s.total)
    worst.per_stage_total = {s.pp_rank: s.total for s in stages}
    return worst


def gib(n: float) -> float:
    return n / GIB


def bytes_table(est: MemoryEstimate) -> List[Tuple[str, int]]:
    rows = [
        ("parameters", est.state.params),
        ("gradients", est.state.grads),
        ("optimizer state (AdamW)", est.state.optimizer),
    ]
    if est.fsdp_buffers:
        rows.append(("FSDP gathered params/grads", est.fsdp_buffers))
    if est.autocast_copies:
        rows.append(("autocast bf16 weight copies", est.autocast_copies))
    rows.append(("activations", est.activations))
    if est.transient:
        rows.append(("transient (logits, buffers)", est.transient))
    return rows

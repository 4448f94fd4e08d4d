"""The tensors one transformer block (``model/gpt.py``'s ``Block``) saves for backward, one row each.

Every row is one tensor autograd keeps between a block's forward and its backward, counted per token of one micro
batch (``elements`` per token times ``dtype_bytes``), with whether tensor parallelism (``tp_split``: heads / FFN
width split over the tp ranks) and sequence parallelism (``sp_split``: the sequence split over the tp ranks) divide
it. ``d`` = d_model, ``dkv`` = n_kv_heads * head_dim, ``F`` = FFN width, ``a`` = n_heads, ``R`` = residual bytes,
``E`` = compute bytes (no activation checkpointing):

    row                                       elements / token   bytes   tp   sp
    attention_norm.input                      d                  R        -   yes
    attention_norm.stats  (LayerNorm: mean,   2 (RMSNorm: 1)     4        -   yes
                           rstd; RMSNorm: rstd)
    attention_norm.output (wq/wk/wv input)    d                  E        -   yes
    attention.q           (after RoPE)        d                  E       yes  -
    attention.k           (after RoPE)        dkv                E       yes  -
    attention.v                               dkv                E       yes  -
    attention.output      (SDPA out, wo in)   d                  E       yes  -
    attention.lse         (SDPA log-sum-exp)  a                  4       yes  -
    ffn_norm.input / .stats / .output         as attention_norm (output: w1/w3 input)
    feed_forward.w1_out   (silu / gelu in)    F                  E       yes  -
    feed_forward.silu_out                     F                  E       yes  -    (SwiGLU)
    feed_forward.w3_out                       F                  E       yes  -    (SwiGLU)
    feed_forward.w2_in    (silu*w3 / gelu)    F                  E       yes  -

Per position (not per token): RoPE's cos/sin tables cast to the compute dtype, 2 * head_dim elements of E bytes,
when E is not 4 (``model/rope.py``'s ``RotateHalf`` saves the casts; fp32 saves the model's own tables).

Which kernels run decides some rows: CUDA's fused RMSNorm keeps its input and rstd; the composite RMSNorm (CPU,
meta) keeps an fp32 copy of the input and the fp32 normalised ``x * rstd`` (``rms_norm_kernel="composite"``).
Under ``bf16-mixed`` autocast the norms run in fp32 (input kept in fp32) and every linear casts its input itself,
so without sequence parallelism the norm output is kept once per linear reading it (3 for wq/wk/wv, 2 for a SwiGLU
w1/w3, 1 for a GELU w1); under sequence parallelism the shard is cast once before the all-gather
(``parallel/tensor_parallel.py``), so one copy.

Under ``fp8`` (torchao's ``Float8Linear``, tensorwise and rowwise alike) a converted linear saves for backward its
input in the compute dtype (it casts the input to the autocast dtype itself, as ``F.linear`` does under autocast)
and its fp32 weight (a parameter, not counted); the float8 casts of input and weight are made again in backward,
not kept. So the rows are ``bf16-mixed``'s, with one exception measured on the CPU: the composite RMSNorm returns
the residual dtype, so with a bf16 residual stream the linears reading it keep one shared copy of the norm output
(torchao's cast is a no-op on it). ``tests/unit/test_activation_table.py`` counts a converted block's saved
tensors against these rows.

Sequence parallelism: the norms run on the rank's sequence shard, and each linear after them keeps only that shard
of its (all-gathered) input, gathering it again in backward (``tensor_parallel.SequenceGatheredInput``), so every
row is divided by tp. ``linear_inputs="gathered"`` counts the norm outputs the way a plain all-gather before the
linears keeps them (full sequence on every tp rank): the layout before that change, kept as a comparison.

Check against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"): for a
LayerNorm, GELU, multi-head, dropout-free block in 16-bit, the rows scaling with d sum to 32 * d bytes per token:
their 34 * s * b * h less the two s * b * h dropout masks (the a * s^2 * b softmax terms are absent: SDPA keeps
only the fp32 log-sum-exp). With tp and sequence parallelism: 32 * s * b * h / t; with tp alone:
8 * s * b * h + 24 * s * b * h / t.

Selective checkpointing (``parallel/activation_checkpoint.py``: matmul and SDPA outputs saved, element-wise ops
recomputed) keeps, besides the block input: the outputs of wq, wk, wv (d + 2 dkv, tp), of wo and w2 (d each, the
rank's partial sums before their all-reduce / reduce-scatter: not divided), of w1 (and w3) (F each, tp) and of SDPA
(d and a * 4 bytes, tp); with ``selective_matmuls="alternate"`` (torchtitan's op policy) the even matmuls' outputs
are recomputed instead: wk, wo and w3 in a SwiGLU block, wk, wo and w2 in a GELU one. Full checkpointing keeps the
block input. ``modules`` keeps the rows above less those of
the parts it recomputes (``RECOMPUTED_ROWS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from lmforge.config.model import ModelConfig
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import kv_heads

FP32 = 4  # norm statistics and SDPA's log-sum-exp are fp32 in every precision
RMS_NORM_KERNELS = ("fused", "composite")
LINEAR_INPUTS = ("shard", "gathered")


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a block keeps for backward: ``elements`` per token (per sequence position if ``per_position``)."""

    name: str
    elements: int
    dtype_bytes: int
    tp_split: bool
    sp_split: bool
    per_position: bool = False

    def bytes(self, *, tokens: int, positions: int, tp: int, sp: bool) -> int:
        count = (positions if self.per_position else tokens) * self.elements * self.dtype_bytes
        if self.tp_split or (sp and self.sp_split):
            count //= tp
        return count


@dataclass(frozen=True)
class BlockPrecision:
    """Bytes per element of the residual stream (norm inputs) and of the block's compute, and whether bf16
    autocast is on (norms in fp32, every linear casting its own input)."""

    residual: int
    compute: int
    autocast: bool = False
    float8: bool = False  # train.precision=fp8: the blocks' linears are torchao Float8Linear (parallel/float8.py)


def _norm_rows(prefix: str, m: ModelConfig, p: BlockPrecision, rms_norm_kernel: str) -> Tuple[SavedTensor, ...]:
    d = m.d_model
    stored = FP32 if p.autocast else p.residual  # autocast runs the norms in fp32
    if m.norm == "layernorm":
        return (
            SavedTensor(f"{prefix}.input", d, stored, False, True),
            SavedTensor(f"{prefix}.stats", 2, FP32, False, True),
        )
    if rms_norm_kernel == "fused":
        return (
            SavedTensor(f"{prefix}.input", d, stored, False, True),
            SavedTensor(f"{prefix}.stats", 1, FP32, False, True),
        )
    return (  # composite: x.float(), rsqrt(mean(x^2) + eps), x * rstd, all fp32
        SavedTensor(f"{prefix}.input", d, FP32, False, True),
        SavedTensor(f"{prefix}.stats", 1, FP32, False, True),
        SavedTensor(f"{prefix}.normalized", d, FP32, False, True),
    )


def _linear_input(
    name: str, m: ModelConfig, p: BlockPrecision, readers: int, linear_inputs: str, rms_norm_kernel: str
) -> SavedTensor:
    """A norm output read by ``readers`` linears; under sequence parallelism ``sp_split`` says whether each linear
    keeps the shard (``shard``) or the all-gathered sequence (``gathered``)."""
    copies = readers if (p.autocast and linear_inputs == "gathered") else 1
    if p.float8 and rms_norm_kernel == "composite" and p.residual == p.compute:
        copies = 1  # the norm output is already in the compute dtype: each Float8Linear's cast returns it as is
    return SavedTensor(name, m.d_model * copies, p.compute, False, linear_inputs == "shard")


def block_saved_tensors(
    m: ModelConfig,
    p: BlockPrecision,
    *,
    sp: bool = False,
    rms_norm_kernel: str = "fused",
    linear_inputs: str = "shard",
) -> Tuple[SavedTensor, ...]:
    """The rows of the module docstring for a dense block of ``m`` without activation checkpointing.
    ``sp``: sequence parallelism (with autocast, decides how many copies of a norm output the linears keep)."""
    if rms_norm_kernel not in RMS_NORM_KERNELS or linear_inputs not in LINEAR_INPUTS:
        raise ValueError(f"rms_norm_kernel={rms_norm_kernel!r}, linear_inputs={linear_inputs!r}")
    if not sp and p.autocast:
        linear_inputs = "gathered"  # one plain tensor read by each linear, each casting its own copy
    d, dkv, f, e = m.d_model, kv_heads(m) * (m.d_model // m.n_heads), ffn_hidden_dim(m), p.compute
    gated = m.mlp == "swiglu"
    rows = [
        *_norm_rows("attention_norm", m, p, rms_norm_kernel),
        _linear_input("attention_norm.output", m, p, 3, linear_inputs, rms_norm_kernel),
        SavedTensor("attention.q", d, e, True, False),
        SavedTensor("attention.k", dkv, e, True, False),
        SavedTensor("attention.v", dkv, e, True, False),
        SavedTensor("attention.output", d, e, True, False),
        SavedTensor("attention.lse", m.n_heads, FP32, True, False),
        *_norm_rows("ffn_norm", m, p, rms_norm_kernel),
        _linear_input("ffn_norm.output", m, p, 2 if gated else 1, linear_inputs, rms_norm_kernel),
        SavedTensor("feed_forward.w1_out", f, e, True, False),
    ]
    if gated:
        rows += [
            SavedTensor("feed_forward.silu_out", f, e, True, False),
            SavedTensor("feed_forward.w3_out", f, e, True, False),
        ]
    rows.append(SavedTensor("feed_forward.w2_in", f, e, True, False))
    if e != FP32:
        rows.append(SavedTensor("attention.rope_tables", 2 * (d // m.n_heads), e, False, False, per_position=True))
    return tuple(rows)


def selective_saved_tensors(m: ModelConfig, p: BlockPrecision, matmuls: str = "all") -> Tuple[SavedTensor, ...]:
    """What selective checkpointing keeps besides the block input: every matmul's and SDPA's outputs, or with
    ``matmuls="alternate"`` SDPA's and the odd matmuls' (the block's matmuls in order: wq, wk, wv, wo, w1, [w3,]
    w2)."""
    d, dkv, f, e = m.d_model, kv_heads(m) * (m.d_model // m.n_heads), ffn_hidden_dim(m), p.compute
    rows = [
        SavedTensor("attention.wq_out", d, e, True, False),
        SavedTensor("attention.wk_out", dkv, e, True, False),
        SavedTensor("attention.wv_out", dkv, e, True, False),
        SavedTensor("attention.output", d, e, True, False),
        SavedTensor("attention.lse", m.n_heads, FP32, True, False),
        SavedTensor("attention.wo_out", d, e, False, False),
        SavedTensor("feed_forward.w1_out", f, e, True, False),
    ]
    if m.mlp == "swiglu":
        rows.append(SavedTensor("feed_forward.w3_out", f, e, True, False))
    rows.append(SavedTensor("feed_forward.w2_out", d, e, False, False))
    if matmuls == "alternate":
        order = [r.name for r in rows if r.name.endswith("_out")]
        recomputed = set(order[1::2])
        rows = [r for r in rows if r.name not in recomputed]
    return tuple(rows)


# What each part activation_checkpointing=modules recomputes drops from the block's rows (by row name or prefix):
# the attention kernel's log-sum-exp (its q, k, v are its saved inputs, its output the out-projection's input),
# the MLP's intermediates (its input, the norm's output, stays), the norms' statistics and fp32 copies (their
# inputs stay; their outputs are the next linears' inputs).
RECOMPUTED_ROWS = {
    "attention_core": ("attention.lse",),
    "mlp": ("feed_forward.",),
    "norms": ("attention_norm.stats", "attention_norm.normalized", "ffn_norm.stats", "ffn_norm.normalized"),
}


def modules_saved_tensors(rows: Tuple[SavedTensor, ...], modules: Sequence[str]) -> Tuple[SavedTensor, ...]:
    """``rows`` (``block_saved_tensors``) less what recomputing ``modules`` (``RECOMPUTED_ROWS``' keys) drops."""
    dropped = tuple(name for part in modules for name in RECOMPUTED_ROWS[part])
    return tuple(r for r in rows if not r.name.startswith(dropped))


def block_input(m: ModelConfig, p: BlockPrecision) -> SavedTensor:
    """The residual stream entering the block: what checkpointing keeps to recompute it."""
    return SavedTensor("block.input", m.d_model, p.residual, False, True)


def table_bytes(rows: Tuple[SavedTensor, ...], *, tokens: int, positions: int, tp: int = 1, sp: bool = False) -> int:
    """Sum of the rows' bytes on one rank (``tokens`` = micro_batch * seq_len, ``positions`` = seq_len)."""
    return sum(r.bytes(tokens=tokens, positions=positions, tp=tp, sp=sp) for r in rows)

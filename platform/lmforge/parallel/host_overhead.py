"""Host time per operator: what an eager training step spends dispatching ops, beside the work the ops do.

Small models are dominated by it: every ATen op of the forward, of autograd's backward and of the optimizer
passes through the Python frontend, the dispatcher and autograd before its kernel runs. The step model
(``lmforge.parallel.step_model``) adds ``ops x op_overhead_s``:

- **ops per step** are counted, not estimated: ``ops_per_micro_batch`` runs one micro batch of the model (forward,
  the chunked cross-entropy, backward) on the meta device under a ``TorchDispatchMode`` that counts every ATen op
  dispatched (views included: each is a dispatch), and ``OPTIMIZER_OPS`` the fused AdamW step and the gradient
  clip. A block's count does not depend on its sizes, so
  it is taken once per shape family (cached).
- **element-wise bytes on a CPU** are counted too (``eager_block_bytes``): the bytes every element-wise op of a block
  reads and writes as eager PyTorch runs them one by one (an RMSNorm is a square, a mean, a reciprocal square root
  and two products; rotary a few products and a sum per half), not the fused kernels' bytes a GPU's table counts.
- **the loss on a CPU** is bound by the exp of every logit rather than by its bytes: ``measure_loss_rate`` times
  the model's own chunked cross-entropy, forward and backward, at the step's logits shape (logits per second):
  a log-softmax pass forward, a softmax pass and the gradient's write backward (``step_model.head_pass``).
- **seconds per op** on a CPU are measured on the machine (``measure_op_overhead``: a chain of small element-wise
  ops with autograd, forward and backward, timed and divided by the ops it dispatched, counted the same way),
  as the GEMM rate is; on a GPU the host dispatches asynchronously and only the part of it that exceeds the
  kernels' time shows (``device_table.HOST_OP_OVERHEAD_GPU_S``).
- **timing on a shared host** (``least_disturbed_s``): every CPU measurement here is the calling thread's CPU time
  (``time.thread_time``: at one torch thread every kernel runs on it, and the time other processes hold its core is
  not counted), the minimum over repeats (the least-disturbed one, the usual microbenchmark practice).
"""

from __future__ import annotations

import contextlib
import math
import time
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.config.model import ModelConfig
from lmforge.config.schema import RootConfig
from lmforge.model.gpt import GPT, cross_entropy_loss

# The optimizer step's ops: the gradient clip (foreach norms, their norm, the clip coefficient, one foreach scale)
# and one fused AdamW call; ``zero_grad(set_to_none=True)`` dispatches none.
OPTIMIZER_OPS = 8


# Ops whose work is a GEMM or the attention core (timed by their FLOPs), or that move no bytes (aliases, allocation).
_NOT_ELEMENTWISE = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product", "_unsafe_view", "_reshape_alias", "empty")


def _tensor_bytes(values) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class _CountOps(TorchDispatchMode):
    """Counts every ATen op dispatched, and the bytes the element-wise ones read and write (inputs and outputs of
    every op that is neither a view nor a GEMM nor the attention core)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.elementwise_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and not name.startswith(_NOT_ELEMENTWISE):
            outs = out if isinstance(out, (list, tuple)) else (out,)
            flat = [a for v in args for a in (v if isinstance(v, (list, tuple)) else (v,))]
            self.elementwise_bytes += _tensor_bytes(flat) + _tensor_bytes(outs)
        return out


class _FusedAttention(torch.autograd.Function):
    """The attention core as the fused kernel a CPU or GPU runs (one op forward, one backward), in place of the
    math decomposition the meta device would dispatch (its softmax and masks are no element-wise work of the step)."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.shapes = (q.shape, k.shape, v.shape)
        return q.new_empty(q.shape[:-1] + v.shape[-1:])

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.new_empty(shape) for shape in ctx.shapes)


class _AttentionAsOneOp(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])
        return func(*args, **(kwargs or {}))


@lru_cache(maxsize=128)
def _count(model_key: tuple, micro: int, seq: int, layers: int, fused_attention: bool = False) -> tuple:
    """(ops, element-wise bytes forward, element-wise bytes backward) of one micro batch, loss included; with
    ``fused_attention`` the attention core is one op each way (``_FusedAttention``), else the meta device's math."""
    cfg = _model_from_key(model_key, seq, layers)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(micro, seq, dtype=torch.long, device="meta")
    with _CountOps() as counter, _AttentionAsOneOp() if fused_attention else contextlib.nullcontext():
        loss = cross_entropy_loss(model(tokens), tokens)
        forward_bytes = counter.elementwise_bytes
        loss.backward()
    return counter.ops, forward_bytes, counter.elementwise_bytes - forward_bytes


def _model_key(cfg: RootConfig) -> tuple:
    m = cfg.model
    return (
        m.vocab_size,
        m.d_model,
        m.n_heads,
        m.n_kv_heads,
        m.d_ff,
        m.ffn_multiple_of,
        m.mlp,
        m.norm,
        m.tie_embeddings,
    )


def _model_from_key(key: tuple, seq: int, layers: int) -> ModelConfig:
    vocab, d, heads, kv, d_ff, multiple, mlp, norm, tied = key
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=d_ff,
        ffn_multiple_of=multiple,
        seq_len=seq,
        mlp=mlp,
        norm=norm,
        tie_embeddings=tied,
    )


def ops_per_micro_batch(cfg: RootConfig, micro: int) -> tuple:
    """(ops of one block, ops of the rest: embedding, head and loss), forward + backward of one micro batch of a
    dense model, counted on the meta device (two counts, with 1 and 2 blocks)."""
    key, seq = _model_key(cfg), cfg.model.seq_len
    one, two = _count(key, micro, seq, 1)[0], _count(key, micro, seq, 2)[0]
    return two - one, one - (two - one)


def eager_block_bytes(cfg: RootConfig, micro: int) -> tuple:
    """(forward, backward) bytes that one block's element-wise ops read and write in eager fp32, one micro batch:
    every op but views, GEMMs and the attention core, each through memory on its own (a CPU runs them unfused),
    counted on the meta device as the ops are (two counts, with 1 and 2 blocks)."""
    key, seq = _model_key(cfg), cfg.model.seq_len
    one, two = _count(key, micro, seq, 1, True), _count(key, micro, seq, 2, True)
    return two[1] - one[1], two[2] - one[2]


def least_disturbed_s(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the calling thread's CPU time of ``fn()``, the minimum of ``repeats`` calls after one warm-up:
    on a shared host neither the time another process holds the core nor the slower repeats count."""
    fn()
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return max(best, 1e-9)


def measure_op_overhead(chain: int = 200, repeats: int = 5) -> float:
    """Seconds of host time per dispatched op on this machine: forward and backward of ``chain`` small
    element-wise ops (64 elements) with autograd, divided by the ATen ops they dispatch (``least_disturbed_s``)."""
    x = torch.randn(64, requires_grad=True)

    def run():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    with _CountOps() as counter:
        run()
    return least_disturbed_s(run, repeats) / counter.ops


def measure_loss_rate(rows: int = 512, vocab: int = 8192, repeats: int = 5) -> float:
    """Logits per second through the loss on this machine (fp32): ``chunked_cross_entropy`` forward and backward
    over ``rows x vocab`` logits (``cross_entropy_loss``), as the step runs it (a fresh gradient each time), ``least_disturbed_s`` of ``repeats``."""
    logits = torch.randn(1, rows, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (1, rows), generator=torch.Generator().manual_seed(0))

    def loss_pass() -> None:
        torch.autograd.grad(cross_entropy_loss(logits, targets), logits)

    return logits.numel() / least_disturbed_s(loss_pass, repeats)

"""Host time per operator: what an eager training step spends dispatching ops, beside the work the ops do.

Small models are dominated by it: every ATen op of the forward, of autograd's backward and of the optimizer
passes through the Python frontend, the dispatcher and autograd before its kernel runs. The step model
(``lmforge.parallel.step_model``) adds ``ops x op_overhead_s``:

- **ops per step** are counted, not estimated: ``ops_per_micro_batch`` runs one micro batch of the model (forward,
  the chunked cross-entropy, backward) on the meta device under a ``TorchDispatchMode`` that counts every ATen op
  dispatched (views included: each is a dispatch), and ``OPTIMIZER_OPS`` the fused AdamW step and the gradient
  clip. A block's count does not depend on its sizes, so
  it is taken once per shape family (cached).
- **the loss on a CPU** is bound by the exp of every logit rather than by its bytes: ``measure_loss_rate`` times
  the model's own chunked cross-entropy, forward and backward, at the step's logits shape (logits per second):
  a log-softmax pass forward, a softmax pass and the gradient's write backward (``step_model.head_pass``).
- **seconds per op** on a CPU are measured on the machine (``measure_op_overhead``: a chain of small element-wise
  ops with autograd, forward and backward, timed and divided by the ops it dispatched, counted the same way),
  as the GEMM rate is; on a GPU the host dispatches asynchronously and only the part of it that exceeds the
  kernels' time shows (``device_table.HOST_OP_OVERHEAD_GPU_S``).
"""

from __future__ import annotations

import statistics
import time
from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.config.model import ModelConfig
from lmforge.config.schema import RootConfig
from lmforge.model.gpt import GPT, cross_entropy_loss

# The optimizer step's ops: the gradient clip (foreach norms, their norm, the clip coefficient, one foreach scale)
# and one fused AdamW call; ``zero_grad(set_to_none=True)`` dispatches none.
OPTIMIZER_OPS = 8


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@lru_cache(maxsize=64)
def _count(model_key: tuple, micro: int, seq: int, layers: int) -> int:
    cfg = _model_from_key(model_key, seq, layers)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(micro, seq, dtype=torch.long, device="meta")
    with _CountOps() as counter:
        loss = cross_entropy_loss(model(tokens), tokens)
        loss.backward()
    return counter.ops


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
    one, two = _count(key, micro, seq, 1), _count(key, micro, seq, 2)
    return two - one, one - (two - one)


def measure_op_overhead(chain: int = 200, repeats: int = 5) -> float:
    """Seconds of host time per dispatched op on this machine: forward and backward of ``chain`` small
    element-wise ops (64 elements) with autograd, divided by the ATen ops they dispatch; median of ``repeats``."""
    x = torch.randn(64, requires_grad=True)

    def run():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    with _CountOps() as counter:
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / counter.ops


def measure_loss_rate(rows: int = 512, vocab: int = 8192, repeats: int = 5) -> float:
    """Logits per second through the loss on this machine (fp32): ``chunked_cross_entropy`` forward and backward
    over ``rows x vocab`` logits (``cross_entropy_loss``), as the step runs it (a fresh gradient each time). Median of ``repeats``."""
    logits = torch.randn(1, rows, vocab, requires_grad=True)
    targets = torch.randint(0, vocab, (1, rows), generator=torch.Generator().manual_seed(0))

    def loss_pass() -> None:
        torch.autograd.grad(cross_entropy_loss(logits, targets), logits)

    loss_pass()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss_pass()
        times.append(time.perf_counter() - t0)
    return logits.numel() / statistics.median(times)

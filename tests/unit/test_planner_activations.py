"""The planner's activation estimate against torch.profiler's memory count on CPU.

The profiler records every allocation and free during one training forward (model + loss); what is
still allocated when the forward returns is exactly what autograd keeps for backward. The planner's
``saved_activation_bytes`` must match it within ACT_TOLERANCE for each activation-checkpointing mode,
on a >= 50M-parameter model and on the other block variants (GELU, LayerNorm, multi-head attention).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lmforge.config.model import ModelConfig
from lmforge.config.schema import RootConfig
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import GPT, cross_entropy_loss, num_parameters
from lmforge.parallel.activation_checkpoint import apply_activation_checkpointing
from lmforge.parallel.memory_estimate import activation_shape, saved_activation_bytes

ACT_TOLERANCE = 0.03  # relative; measured deviations are below 0.1%

MODEL_50M = ModelConfig(
    name="planner_50m",
    vocab_size=32768,
    d_model=512,
    n_layers=12,
    n_heads=8,
    n_kv_heads=4,
    seq_len=256,
    mlp="swiglu",
    norm="rmsnorm",
    tie_embeddings=True,
)
MODEL_GELU = ModelConfig(
    name="planner_gelu",
    vocab_size=4096,
    d_model=256,
    n_layers=3,
    n_heads=4,
    seq_len=128,
    mlp="gelu",
    norm="layernorm",
    tie_embeddings=False,
)


def profiled_forward_bytes(model: torch.nn.Module, cfg: ModelConfig, batch: int) -> int:
    """Net bytes allocated by one forward + loss (what stays alive for backward), from torch.profiler."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = cross_entropy_loss(model(tokens), targets)
    assert loss.requires_grad  # a training forward: autograd saved what backward needs
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.fixture(autouse=True)
def one_thread():
    """Memory does not depend on threads; one thread avoids spinning on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(cfg)  # default init: what is saved does not depend on the values


def checkpointed(model: torch.nn.Module, blocks: dict, mode: str) -> torch.nn.Module:
    """The model with its plain blocks re-wrapped by the engine's activation checkpointing for ``mode``."""
    for name, block in blocks.items():
        model.layers[name] = block
    apply_activation_checkpointing(model, mode)
    return model


def estimate(cfg: ModelConfig, batch: int, mode: str, matmuls: str = "all") -> int:
    root = RootConfig(model=cfg)
    shape = activation_shape(root, batch, "fp32", rms_norm_kernel="composite")  # CPU: the composite RMSNorm
    return saved_activation_bytes(cfg, shape, mode, cfg.n_layers, matmuls=matmuls)


@pytest.mark.timeout(300)
def test_activation_estimate_matches_profiler_on_50m_model():
    rows = []
    model = build(MODEL_50M)
    assert num_parameters(model) >= 50_000_000
    blocks = dict(model.layers.items())
    for mode in ("none", "selective", "full"):
        checkpointed(model, blocks, mode)
        measured = profiled_forward_bytes(model, MODEL_50M, batch=1)
        est = estimate(MODEL_50M, 1, mode)
        rows.append((mode, measured, est, est / measured - 1))
    print(f"\n{num_parameters(model) / 1e6:.1f}M parameters, micro batch 1 x {MODEL_50M.seq_len} tokens, fp32")
    print(f"{'checkpointing':<14}{'profiler MiB':>14}{'planner MiB':>14}{'error':>9}")
    for mode, measured, est, err in rows:
        print(f"{mode:<14}{measured / 2**20:>14.2f}{est / 2**20:>14.2f}{err:>9.2%}")
    for mode, measured, est, err in rows:
        assert abs(err) <= ACT_TOLERANCE, f"{mode}: planner {est} vs profiler {measured} bytes ({err:.2%})"
    # Checkpointing really changes what is kept, in the expected order.
    kept = {mode: measured for mode, measured, _, _ in rows}
    assert kept["full"] < kept["selective"] < kept["none"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_estimate_gelu_layernorm_mha(mode):
    model = build(MODEL_GELU)
    apply_activation_checkpointing(model, mode)
    measured = profiled_forward_bytes(model, MODEL_GELU, batch=2)
    est = estimate(MODEL_GELU, 2, mode)
    assert abs(est / measured - 1) <= ACT_TOLERANCE, f"planner {est} vs profiler {measured} bytes"


MODEL_SWIGLU = ModelConfig(
    name="planner_swiglu", vocab_size=4096, d_model=256, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=128,
    tie_embeddings=False,
)  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", [MODEL_SWIGLU, MODEL_GELU], ids=["swiglu-gqa", "gelu-mha"])
def test_alternate_matmuls_keep_less_by_the_recomputed_outputs(cfg):
    """selective_matmuls=alternate (torchtitan's op policy) against the profiler: the planner's estimate holds,
    and what it saves over keeping every matmul is exactly the even matmuls' outputs (wk, wo and w3 in a SwiGLU
    block, wk, wo and w2 in a GELU one), fp32 here; the gradients equal those of no checkpointing."""
    measured = {}
    grads = {}
    for mode, matmuls in (("none", "all"), ("selective", "all"), ("selective", "alternate")):
        model = build(cfg)
        apply_activation_checkpointing(model, mode, selective_matmuls=matmuls)
        measured[matmuls if mode == "selective" else mode] = profiled_forward_bytes(model, cfg, batch=2)
        if mode == "none" or matmuls == "alternate":
            gen = torch.Generator().manual_seed(2)
            tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
            cross_entropy_loss(model(tokens), tokens).backward()
            grads[mode] = [p.grad for p in model.parameters()]
    est = estimate(cfg, 2, "selective", "alternate")
    assert abs(est / measured["alternate"] - 1) <= ACT_TOLERANCE, f"planner {est} vs {measured['alternate']} bytes"
    hd = cfg.d_model // cfg.n_heads
    last = cfg.d_model if cfg.mlp == "gelu" else ffn_hidden_dim(cfg)  # w2's output or w3's
    recomputed = 2 * cfg.seq_len * cfg.n_layers * 4 * ((cfg.n_kv_heads or cfg.n_heads) * hd + cfg.d_model + last)
    assert abs((measured["all"] - measured["alternate"]) / recomputed - 1) <= ACT_TOLERANCE
    assert measured["alternate"] < measured["all"] < measured["none"]
    for a, b in zip(grads["selective"], grads["none"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

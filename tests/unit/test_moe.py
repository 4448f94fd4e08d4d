"""The Mixture-of-Experts block (model/moe.py): grouped == loop, the output against a per-token reference,
capacity drops counted, balancing that moves an imbalanced router, FLOPs from active parameters, config errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config.errors import ConfigError
from lmforge.config.model import ModelConfig, MoEConfig
from lmforge.config.moe_checks import check_moe
from lmforge.config.schema import RootConfig
from lmforge.model.feed_forward import FeedForward
from lmforge.model.flops import flops_per_token
from lmforge.model.gpt import GPT, cross_entropy_loss, num_parameters, param_count_from_config
from lmforge.model.moe import MoECollector, MoEFeedForward


def cfg_of(d_model: int = 32, n_layers: int = 2, **moe) -> ModelConfig:
    base = dict(experts=4, top_k=2, d_ff=48)
    base.update(moe)
    return ModelConfig(
        vocab_size=97,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        seq_len=16,
        tie_embeddings=False,
        moe=MoEConfig(**base),
    )


def moe_layer(cfg: ModelConfig, seed: int = 0) -> MoEFeedForward:
    model = GPT(cfg)
    model.init_weights(seed)
    return model.layers[str(cfg.n_layers - 1)].feed_forward


def reference(layer: MoEFeedForward, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token: sum over its chosen experts of gate weight * expert(x); an expert serves at most
    ``capacity`` assignments in token order (k-th choice of a token after its (k-1)-th)."""
    flat = x.reshape(-1, x.shape[-1])
    chosen, weights, _, _ = layer.router(flat)
    served = [0] * layer.n_experts
    out = torch.zeros_like(flat)
    ex = layer.experts
    for t in range(flat.shape[0]):
        for j in range(layer.top_k):
            e = int(chosen[t, j])
            served[e] += 1
            if capacity is not None and served[e] > capacity:
                continue
            h = F.silu(flat[t] @ ex.w1[e]) * (flat[t] @ ex.w3[e])
            out[t] += weights[t, j] * (h @ ex.w2[e])
    if layer.shared is not None:
        out = out + layer.shared(flat)
    return out.reshape(x.shape)


CASES = [
    dict(),
    dict(gating="sigmoid", shared_experts=1, top_k=1),
    dict(capacity_factor=0.5),
    dict(experts=8, top_k=3, capacity_factor=1.0, gating="sigmoid"),
]


@pytest.mark.parametrize("moe", CASES)
def test_grouped_equals_loop_and_per_token_reference(moe):
    torch.manual_seed(0)
    grouped, loop = moe_layer(cfg_of(**moe, compute="grouped")), moe_layer(cfg_of(**moe, compute="loop"))
    x = torch.randn(2, 12, 32)
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    yg, yl = grouped(xg), loop(xl)
    g = torch.randn_like(yg)
    yg.backward(g)
    yl.backward(g)
    assert torch.equal(yg, yl) and torch.equal(xg.grad, xl.grad)
    for (name, pg), (_, pl) in zip(grouped.named_parameters(), loop.named_parameters()):
        assert torch.equal(pg.grad, pl.grad), name
    cf = moe.get("capacity_factor")
    n_assign = 24 * grouped.top_k
    capacity = math.ceil(cf * n_assign / grouped.n_experts) if cf is not None else None
    with torch.no_grad():
        assert torch.allclose(yg, reference(grouped, x, capacity), atol=1e-6)
    # dropped assignments: counted exactly (and none when dropless)
    loads = grouped.last.tokens_per_expert
    expected = (loads - capacity).clamp(min=0).sum() if capacity is not None else 0
    assert grouped.last.dropped == expected and loads.sum() == n_assign
    if capacity is None:
        assert grouped.last.dropped == 0
    else:
        assert grouped.last.dropped > 0  # these capacities are small enough to drop


def test_reference_catches_a_misrouted_token():
    """Negative control: the reference comparison fails when one token's output goes to another token."""
    layer = moe_layer(cfg_of())
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        y = layer(x).reshape(-1, 32)
        y[[0, 1]] = y[[1, 0]]
        assert not torch.allclose(y.reshape(x.shape), reference(layer, x), atol=1e-6)


def test_dense_default_and_param_counts():
    dense = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    model = GPT(dense)
    assert not any(isinstance(m, MoEFeedForward) for m in model.modules())
    assert not MoECollector(model, dense.moe)
    for moe, kinds in (
        (dict(), [True, True]),
        (dict(shared_experts=2, every_n_layers=2), [False, True]),
        (dict(layers=[0], d_ff=None), [True, False]),
    ):
        cfg = cfg_of(**moe)
        model = GPT(cfg)
        assert num_parameters(model) == param_count_from_config(cfg)
        assert [isinstance(b.feed_forward, MoEFeedForward) for b in model.layers.values()] == kinds
        moe_layer_name = f"layers.{kinds.index(True)}.feed_forward"
        assert f"{moe_layer_name}.router.expert_bias" in model.state_dict()  # checkpointed with the model


@pytest.mark.parametrize("moe", [dict(compute="loop"), dict(compute="loop", shared_experts=1, top_k=1)])
def test_flops_count_active_parameters(moe):
    """Dropless routing sends exactly N * top_k assignments, so the FLOP counter agrees with the formula (on the
    loop path: torch 2.13's FlopCounterMode has no formula for _grouped_mm)."""
    cfg = cfg_of(**moe)
    model = GPT(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        cross_entropy_loss(model(tokens), tokens).backward()
    assert counter.get_total_flops() == flops_per_token(cfg) * cfg.seq_len
    dense_all = cfg_of(**{**moe, "top_k": cfg.moe.experts})  # every expert active: more FLOPs
    assert flops_per_token(dense_all) > flops_per_token(cfg)


def _imbalanced(layer: MoEFeedForward, x: torch.Tensor) -> None:
    """Point the router at the inputs' mean direction for experts 0 and 1 (the others' rows made small): ~96% of
    the assignments go to them, yet the softmax is not saturated (the aux loss has a gradient)."""
    with torch.no_grad():
        mean = x.mean(0)
        layer.router.gate.weight[:2] = mean / mean.norm()
        layer.router.gate.weight[2:] *= 0.1


@pytest.mark.parametrize(
    "gating, aux_loss_coef, bias_update_rate, balances",
    [
        ("softmax", 1.0, 0.0, True),
        ("softmax", 0.0, 0.01, True),
        ("sigmoid", 0.0, 0.02, True),
        ("softmax", 0.0, 0.0, False),
    ],
)
def test_balancing_moves_an_imbalanced_router(gating, aux_loss_coef, bias_update_rate, balances):
    """A router sending almost everything to 2 of 8 experts (top-2, load max/mean ~3.8 of 4): 60 steps of the aux
    loss (Adam on the router) or of the bias update bring the last 10 steps' mean load max/mean under 2; with
    neither (the control) it stays where it was."""
    torch.manual_seed(0)
    cfg = cfg_of(experts=8, top_k=2, gating=gating, aux_loss_coef=aux_loss_coef, bias_update_rate=bias_update_rate)
    layer = moe_layer(cfg)
    x = torch.randn(256, 32) + 0.3
    _imbalanced(layer, x)
    collector = MoECollector(layer, cfg.moe)
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.1)
    history = []
    for _ in range(60):
        layer(x)
        loss = collector.router_loss()
        if aux_loss_coef > 0:
            opt.zero_grad()
            loss.backward()
            opt.step()
        if bias_update_rate > 0:
            collector.update_bias(collector.loads)
        metrics = collector.step_metrics()
        assert metrics["moe/dropped"] == 0  # dropless
        history.append(float(metrics["moe/load_max_over_mean"]))
    assert history[0] > 3.5, history[0]
    late = sum(history[-10:]) / 10
    assert (late < 2.0) == balances, (history[0], late)
    assert torch.count_nonzero(layer.router.expert_bias) == (8 if bias_update_rate > 0 else 0)


def root(**moe) -> RootConfig:
    r = RootConfig()
    r.model.moe = MoEConfig(**moe)
    return r


@pytest.mark.parametrize(
    "moe, layout, key, reason",
    [
        (dict(experts=1), {}, "model.moe.experts", "must be 0 (dense) or >= 2, got 1"),
        (dict(experts=4, top_k=5), {}, "model.moe.top_k", "must be in [1, experts=4], got 5"),
        (dict(experts=4, layers=[7]), {}, "model.moe.layers", "layer indices must be in [0, n_layers=4), got [7]"),
        (dict(experts=4, capacity_factor=0.0), {}, "model.moe.capacity_factor", "must be > 0 or null, got 0.0"),
        (dict(experts=4, aux_loss_coef=-1.0), {}, "model.moe.aux_loss_coef", "must be >= 0, got -1.0"),
        (
            dict(experts=4),
            {"cp": 2},
            "parallelism.cp",
            "not supported with model.moe.experts > 0: context-parallel ranks "
            "route different tokens and the expert loads (and the bias update) are summed over data-parallel ranks only",
        ),
    ],
)
def test_config_errors_name_key_reason_fix(moe, layout, key, reason):
    cfg = root(**moe)
    for k, v in layout.items():
        setattr(cfg.parallelism, k, v)
    with pytest.raises(ConfigError) as err:
        check_moe(cfg)
    assert err.value.key == key and err.value.reason == reason and err.value.fix
    check_moe(root(experts=4))  # control: a valid MoE config passes
    composed = root(experts=4)
    composed.parallelism.pp, composed.parallelism.tp = 2, 2  # pp and tp compose with MoE (parity-tested)
    composed.parallelism.compile = True  # and compile (test_moe_compile, test_compile_layouts)
    check_moe(composed)
    check_moe(RootConfig())  # and the dense default


def test_shared_feed_forward_width():
    ff = FeedForward(cfg_of(), hidden=24)
    assert ff.w1.weight.shape == (24, 32)


def test_hf_export_picks_the_exact_moe_class_or_refuses_in_one_line():
    """Mixtral for every-layer renormalised top-k without shared experts, Qwen2-MoE otherwise (interop/moe_mapping.py,
    logits checked in tests/unit/test_interop_hf.py); sigmoid gating maps to neither and is refused."""
    from lmforge.interop.errors import InteropError
    from lmforge.interop.mapping import family_for

    assert family_for(cfg_of()).architecture == "MixtralForCausalLM"
    assert family_for(cfg_of(shared_experts=1)).architecture == "Qwen2MoeForCausalLM"
    assert family_for(cfg_of(top_k=1)).architecture == "Qwen2MoeForCausalLM"  # Mixtral would renormalise to 1
    with pytest.raises(InteropError) as err:
        family_for(cfg_of(gating="sigmoid"))
    assert str(err.value) == (
        "model.moe.gating='sigmoid': Mixtral and Qwen2-MoE route by a softmax over the experts; "
        "sigmoid gating (DeepSeek-V3) has no exact Hugging Face class here. Fix: export models "
        "trained with model.moe.gating=softmax"
    )
    assert family_for(ModelConfig()).name == "llama"  # control: the dense model keeps its family

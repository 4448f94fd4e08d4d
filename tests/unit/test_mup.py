"""model.parametrization=mup (model/mup.py): name-keyed init, the optimizer's per-group multipliers (and their
checkpoint round trip per parameter name), the logit multiplier and the attention scale through the kernel's
``scale=``. The coordinate check is tests/e2e/test_mup_coord_check.py; the HF export, tests/unit/test_interop_hf.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.safe_io import tensor_metadata
from lmforge.checkpoint.state_io import DcpStateIO
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.model import ModelConfig
from lmforge.config.optim import OptimConfig
from lmforge.model import mup
from lmforge.model.gpt import GPT, Attention, causal_attention
from lmforge.optim.adamw import build_optimizer, set_learning_rate

CPU = torch.device("cpu")


def cfg(width: int = 128, **kw) -> ModelConfig:
    base = dict(vocab_size=96, d_model=width, n_layers=2, n_heads=4, seq_len=16, tie_embeddings=False)
    base.update(parametrization="mup", mup_base_width=32, **kw)
    return ModelConfig(**base)


def built(c: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(c)
    model.init_weights(seed)
    return model


def test_roles_come_from_names_alone():
    assert mup.param_role("tok_embeddings.weight", 2) == mup.EMBEDDING
    assert mup.param_role("output.weight", 2) == mup.OUTPUT
    assert mup.param_role("layers.3.attention.wq.weight", 2) == mup.HIDDEN
    assert mup.param_role("layers.0.feed_forward.experts.w1", 3) == mup.HIDDEN
    assert mup.param_role("layers.0.ffn_norm.weight", 1) == mup.VECTOR


def test_init_scales_hidden_std_by_one_over_sqrt_width_and_equals_sp_at_the_base_width():
    c = cfg(512)  # m = 16
    model = built(c)
    params = dict(model.named_parameters())
    assert params["output.weight"].std().item() == pytest.approx(c.init_std, rel=0.03)  # times 1/m in the forward
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(c.init_std, rel=0.03)
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(c.init_std / 4, rel=0.03)
    residual = c.init_std / 4 / math.sqrt(2 * c.n_layers)
    assert params["layers.1.feed_forward.w2.weight"].std().item() == pytest.approx(residual, rel=0.03)
    # at the base width µP's init is SP's, bit for bit; wider, only the hidden matrices differ
    at_base = built(cfg(32)).state_dict()
    sp = built(replace(cfg(32), parametrization="sp")).state_dict()
    assert all(torch.equal(sp[k], at_base[k]) for k in sp)
    wide_sp = built(replace(c, parametrization="sp")).state_dict()
    differ = {k for k, v in model.state_dict().items() if not torch.equal(v, wide_sp[k])}
    assert differ == {n for n, p in params.items() if mup.param_role(n, p.ndim) == mup.HIDDEN}


def test_optimizer_groups_carry_lr_and_weight_decay_multipliers():
    c = cfg(128)  # m = 4
    model = built(c)
    opt = build_optimizer(model, OptimConfig(lr=0.01, weight_decay=0.1), CPU, c)
    name_of = {id(p): n for n, p in model.named_parameters()}
    hyper = {name_of[id(p)]: (g["lr_mult"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    assert hyper["layers.0.attention.wk.weight"] == (0.25, pytest.approx(0.4))
    assert hyper["layers.1.feed_forward.w3.weight"] == (0.25, pytest.approx(0.4))
    assert hyper["tok_embeddings.weight"] == (1.0, 0.1) and hyper["output.weight"] == (1.0, 0.1)
    assert hyper["norm.weight"] == (1.0, 0.0) and hyper["layers.0.attention_norm.weight"] == (1.0, 0.0)
    set_learning_rate(opt, 0.02)
    assert sorted(g["lr"] for g in opt.param_groups) == [0.005, 0.02, 0.02]
    # the standard parametrization keeps its two groups (and its checkpoints) unchanged: no multiplier key
    sp = replace(c, parametrization="sp")
    sp_opt = build_optimizer(built(sp), OptimConfig(lr=0.01, weight_decay=0.1), CPU, sp)
    assert [sorted(k for k in g if k != "params") for g in sp_opt.param_groups][0].count("lr_mult") == 0
    assert [g["weight_decay"] for g in sp_opt.param_groups] == [0.1, 0.0]


def test_the_groups_round_trip_through_a_checkpoint_per_parameter_name(tmp_path):
    c = cfg(64)
    model = built(c)
    opt = build_optimizer(model, OptimConfig(lr=0.01, weight_decay=0.1), CPU, c)
    x = torch.randint(0, c.vocab_size, (2, c.seq_len))
    model(x).float().pow(2).mean().backward()
    opt.step()
    path = CheckpointManager(tmp_path, CheckpointConfig()).save(1, model, opt, {"world_size": 1}).path
    assert "optim.param_groups.layers.0.attention.wq.weight.lr_mult" in set(tensor_metadata(path))
    model2 = built(c, seed=1)
    opt2 = build_optimizer(model2, OptimConfig(lr=0.5, weight_decay=0.1), CPU, c)
    DcpStateIO(model2, opt2).load(path, {"world_size": 1}, restore_rng=False)
    assert [(g["lr"], g["lr_mult"]) for g in opt2.param_groups] == [(g["lr"], g["lr_mult"]) for g in opt.param_groups]
    wq, wq2 = model.layers["0"].attention.wq.weight, model2.layers["0"].attention.wq.weight
    assert torch.equal(wq2, wq) and torch.equal(opt2.state[wq2]["exp_avg"], opt.state[wq]["exp_avg"])


def test_logits_are_multiplied_by_base_over_width():
    c = cfg(128)
    model = built(c)
    with torch.no_grad():
        model.output.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
        x = torch.randint(0, c.vocab_size, (2, c.seq_len))
        model.output.multiplier = 1.0
        plain = model(x)
        model.output.multiplier = mup.output_multiplier(c)
        assert model.output.multiplier == 0.25
        torch.testing.assert_close(model(x), plain * 0.25)


def test_the_attention_scale_goes_through_the_kernels_scale_argument(monkeypatch):
    c = cfg(128)  # head_dim 32, base head dim 8: scale sqrt(8) / 32
    seen = []

    def recording(q, k, v, scale=None):
        seen.append(scale)
        return causal_attention(q, k, v, scale=scale)

    monkeypatch.setattr(Attention, "attend", staticmethod(recording))
    model = built(c)
    x = torch.randint(0, c.vocab_size, (1, c.seq_len))
    with torch.no_grad():
        model(x)
    assert seen == [math.sqrt(8) / 32] * c.n_layers
    q, k, v = (torch.randn(1, 4, 16, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    scores = (q @ k.transpose(-1, -2)) * seen[0]
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(causal_attention(q, k, v, scale=seen[0]), F.softmax(scores, -1) @ v)
    seen.clear()
    with torch.no_grad():
        built(replace(c, parametrization="sp"))(x)
    assert seen == [None] * c.n_layers  # SP: the kernel's own 1/sqrt(head_dim)


def test_the_base_head_dim_fixes_the_attention_scale_when_heads_grow():
    by_width = cfg(128)  # 4 heads of 32; base 32 wide, 4 heads of 8
    assert mup.attention_scale(by_width) == math.sqrt(8) / 32
    by_heads = cfg(128, n_heads=16, mup_base_head_dim=8)  # heads of 8 at every width: SP's 1/sqrt(8)
    assert mup.attention_scale(by_heads) == pytest.approx(1 / math.sqrt(8))

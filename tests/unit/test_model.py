"""Model shapes, the causal mask, batch isolation, and initialisation that does not depend on construction."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.model import ModelConfig
from lmforge.model.gpt import GPT, num_parameters, param_count_from_config


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def build(cfg: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(cfg)
    model.init_weights(seed)
    return model


@pytest.mark.parametrize(
    "kw", [{}, {"n_kv_heads": 1}, {"n_kv_heads": None}, {"mlp": "gelu", "norm": "layernorm"}, {"tie_embeddings": False}]
)
def test_shapes_and_param_count(kw):
    cfg = tiny(**kw)
    model = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert model(tokens).shape == (3, cfg.seq_len, cfg.vocab_size)
    assert num_parameters(model) == param_count_from_config(cfg)


def test_kv_projection_shapes_follow_kv_heads():
    model = build(tiny(n_kv_heads=1))
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (32, 32) and attn.wk.weight.shape == (8, 32) and attn.wv.weight.shape == (8, 32)


@torch.no_grad()
def test_no_future_leakage():
    cfg = tiny()
    model = build(cfg).eval()
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    base = model(tokens)
    for t in range(cfg.seq_len - 1):
        changed = tokens.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + t) % cfg.vocab_size
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t + 1], base[:, t + 1])


@torch.no_grad()
def test_batch_rows_are_independent():
    cfg = tiny()
    model = build(cfg).eval()
    torch.manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    base = model(tokens)
    for b in range(4):
        changed = tokens.clone()
        changed[b] = torch.randint(0, cfg.vocab_size, (cfg.seq_len,))
        out = model(changed)
        others = [i for i in range(4) if i != b]
        torch.testing.assert_close(out[others], base[others], rtol=0, atol=1e-6)


def test_meta_init_equals_eager_init():
    cfg = tiny()
    eager = build(cfg, seed=7)
    with torch.device("meta"):
        lazy = GPT(cfg)
    lazy.to_empty(device="cpu")
    lazy.init_weights(7)
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2
        assert torch.equal(p1, p2), n1
    torch.testing.assert_close(lazy.rope_cos, eager.rope_cos, rtol=0, atol=0)


def test_init_is_keyed_by_name_not_order():
    cfg = tiny()
    a = build(cfg, seed=3)
    b = build(cfg, seed=3)
    c = build(cfg, seed=4)
    assert torch.equal(a.layers["1"].attention.wq.weight, b.layers["1"].attention.wq.weight)
    assert not torch.equal(a.layers["1"].attention.wq.weight, c.layers["1"].attention.wq.weight)
    # different layers get different values
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    # residual output projections are scaled down
    assert a.layers["0"].attention.wo.weight.std() < 0.8 * a.layers["0"].attention.wq.weight.std()


def test_tied_embeddings_share_storage():
    model = build(tiny(tie_embeddings=True))
    assert list(model.output.parameters()) == []  # the tied head owns no weight: it uses the embedding table
    h = torch.randn(1, 3, 32)
    torch.testing.assert_close(model.output(h, model.tok_embeddings.weight), h @ model.tok_embeddings.weight.T)


def test_rope_is_the_rotate_half_formula_bit_for_bit():
    """rope_formula (halves view, flip, signed sin: no cat/neg of activations) equals x*cos + [-x2, x1]*sin
    exactly, for [T, D] tables and per-sample [B, T, D] ones; apply_rope's eager two-pass Function equals it to
    float rounding, values and gradients; a wrong sign (the negative control) does not."""
    from lmforge.model.rope import apply_rope, rope_formula, rope_tables

    torch.manual_seed(0)
    x = torch.randn(2, 16, 3, 8, requires_grad=True)
    cos, sin = rope_tables(8, 16, 10000.0)
    x1, x2 = x[..., :4], x[..., 4:]
    expected = x * cos[None, :, None] + torch.cat([-x2, x1], dim=-1) * sin[None, :, None]
    assert torch.equal(rope_formula(x, cos, sin), expected)
    positions = torch.tensor([list(range(16)), list(range(8)) * 2])  # per-sample tables (restarting positions)
    per_sample = rope_formula(x, cos[positions], sin[positions])
    assert torch.equal(per_sample[0], expected[0]) and torch.equal(per_sample[1, :8], expected[1, :8])
    grad = torch.randn_like(expected).transpose(1, 2)  # a non-contiguous incoming gradient, as from attention
    for c, s in ((cos, sin), (cos[positions], sin[positions])):
        want = rope_formula(x, c, s)
        (want_grad,) = torch.autograd.grad(want.transpose(1, 2), x, grad)
        got = apply_rope(x, c, s)
        assert got.grad_fn.name() == "RotateHalfBackward"  # the eager path is the Function
        (got_grad,) = torch.autograd.grad(got.transpose(1, 2), x, grad)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    wrong_sign = x * cos[None, :, None] + torch.cat([x2, -x1], dim=-1) * sin[None, :, None]
    assert not torch.allclose(apply_rope(x, cos, sin), wrong_sign)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """SDPA's grouped path (enable_gqa) gives the outputs and gradients of repeating each K/V head n_rep times."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(2))
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    repeated = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-6)
    g = torch.randn_like(grouped)
    for a, b in zip(torch.autograd.grad(grouped, (q, k, v), g), torch.autograd.grad(repeated, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    tiled = F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)
    assert not torch.allclose(grouped, tiled)  # head j uses KV head j // n_rep, not j % n_kv

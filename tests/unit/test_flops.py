"""The one FLOPs formula against torch's FlopCounterMode on a real forward + backward."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config.model import ModelConfig
from lmforge.model.flops import flops_per_token, matmul_params
from lmforge.model.gpt import GPT, cross_entropy_loss


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_heads=1, tie_embeddings=True), dict(mlp="gelu", norm="layernorm")])
def test_flops_match_flop_counter(kw):
    cfg = ModelConfig(
        **{
            **dict(vocab_size=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=32, tie_embeddings=False),
            **kw,
        }
    )
    model = GPT(cfg)
    model.init_weights(0)
    batch, seq = 2, cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    # The CPU flash kernel has no FLOP formula registered; the math kernel counts the full T x T square.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss = cross_entropy_loss(model(tokens), tokens)
        loss.backward()
    assert counter.get_total_flops() == flops_per_token(cfg) * batch * seq


def test_matmul_params_counts_output_even_when_tied():
    tied = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=4, tie_embeddings=True)
    untied = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=4, tie_embeddings=False)
    assert matmul_params(tied) == matmul_params(untied)


def test_gpt_125m_flops_per_token_is_sane():
    cfg = ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12, seq_len=1024)
    # ~6N with N~124M plus attention 12*L*d*T
    assert 7.0e8 < flops_per_token(cfg) < 9.0e8

"""Document-masked packing (data.document_masking, model/document_mask.py) on real tiny models and real shards.

Packing parity: every document inside a packed, masked sequence gets the logits, loss and gradients of that
document run alone (within 1e-5), for GQA and MQA; the negative control (mask off) fails that equality.
Masking off is the plain packed path, bit for bit; the loader's positions restart after every EOD of megatron-core's
samples; FlexAttention equals the SDPA reference; FLOPs count the documents' own squares (FlopCounterMode).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config.errors import ConfigError
from lmforge.config.model import ModelConfig
from lmforge.model.document_mask import (
    DocumentMask,
    document_ids,
    document_positions,
    document_square_sum,
    pack_batch,
    segment_sdpa,
    unpack_batch,
    varlen_attention,
    varlen_boundaries,
)
from lmforge.model.flops import document_attention_flops, document_flops_per_token, flops_per_token, matmul_params
from lmforge.model.gpt import GPT, apply_rope

EOD = 0
TOL = 1e-5
# Two packed rows of 32 tokens: documents of these lengths, each ending with EOD (the last one cut by the window,
# as megatron-core cuts samples out of the document stream).
LENGTHS = [[7, 12, 13], [1, 20, 5, 6]]


def tiny(n_kv_heads: int) -> GPT:
    cfg = ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, seq_len=32, tie_embeddings=False
    )
    model = GPT(cfg)
    model.init_weights(0)
    return model


def packed_rows(seed: int = 0):
    """tokens [2, 32], targets [2, 32] (the next token of the stream) and each row's documents as (start, end)."""
    g = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for lengths in LENGTHS:
        docs = [torch.cat([torch.randint(1, 128, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]
        rows.append(torch.cat(docs + [torch.randint(1, 128, (1,), generator=g)]))  # + the token after the window
        starts = torch.tensor([0] + lengths).cumsum(0).tolist()
        spans.append(list(zip(starts[:-1], starts[1:])))
    text = torch.stack(rows)
    return text[:, :-1], text[:, 1:], spans


def test_positions_restart_after_each_eod_and_ids_count_documents():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9], [EOD, 1, 2, 3, 4, 5, 6, 7]])
    positions = document_positions(tokens, EOD)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_square_sum(positions) == (9 + 4 + 1 + 4) + (1 + 49)


def per_document_grads(model: GPT, logits_fn, targets):
    """(logits, summed loss, gradients) of one document's positions."""
    model.zero_grad(set_to_none=True)
    logits = logits_fn()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("n_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_each_packed_document_equals_the_document_alone(n_kv_heads):
    model = tiny(n_kv_heads)
    tokens, targets, spans = packed_rows()
    positions = document_positions(tokens, EOD)
    worst_unmasked = 0.0
    for b, row in enumerate(spans):
        for s, e in row:
            alone = per_document_grads(model, lambda: model(tokens[b : b + 1, s:e])[0], targets[b, s:e])
            packed = per_document_grads(model, lambda: model(tokens, positions=positions)[b, s:e], targets[b, s:e])
            assert torch.allclose(packed[0], alone[0], atol=TOL, rtol=0), f"row {b} doc {s}:{e}: logits"
            assert abs(float(packed[1] - alone[1])) < TOL * (e - s), f"row {b} doc {s}:{e}: loss"
            for name, g in alone[2].items():
                assert torch.allclose(packed[2][name], g, atol=TOL, rtol=0), f"row {b} doc {s}:{e}: grad {name}"
            # Negative control: the same document inside the packed row without the mask (plain packing).
            unmasked = per_document_grads(model, lambda: model(tokens)[b, s:e], targets[b, s:e])
            if s > 0:
                worst_unmasked = max(worst_unmasked, float((unmasked[0] - alone[0]).abs().max()))
    assert worst_unmasked > 1e-2, "without the mask later documents must see earlier ones (the control must fail)"


def unmasked_forward(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """The unmasked forward, written out: causal SDPA over the whole sample, RoPE from 0."""
    bsz, seqlen = tokens.shape
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope.cos[:seqlen], model.rope.sin[:seqlen]
    for layer in model.layers.values():
        a, x = layer.attention, layer.attention_norm(h)
        q, k, v = (w(x).view(bsz, seqlen, -1, a.head_dim) for w in (a.wq, a.wk, a.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(a.n_rep, dim=2), v.repeat_interleave(a.n_rep, dim=2)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        h = h + a.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))


def test_masking_off_is_the_unmasked_forward_bit_for_bit():
    model = tiny(2)
    tokens, _, _ = packed_rows()
    with torch.no_grad():
        off, plain = model(tokens), unmasked_forward(model, tokens)
        masked = model(tokens, positions=document_positions(tokens, EOD))
    assert torch.equal(off, plain)
    assert not torch.allclose(masked, plain, atol=1e-3)  # control: the masked path is a different computation


def test_flex_attention_equals_the_sdpa_reference():
    """CPU: torch 2.13's FlexAttention runs forward only (no CPU backward; config refuses flex training there)."""
    model = tiny(2)
    tokens, _, _ = packed_rows()
    positions = document_positions(tokens, EOD)
    with torch.no_grad():
        reference = model(tokens, positions=positions)
        model.document_attention = "flex"
        with pytest.warns(UserWarning):  # torch announces its unfused eager path
            flex = model(tokens, positions=positions)
    assert torch.allclose(flex, reference, atol=TOL, rtol=0)
    model.document_attention = "sdpa"
    with torch.no_grad():  # control: the flex result is not the unmasked forward
        assert not torch.allclose(flex, model(tokens), atol=1e-3)


def test_varlen_layout_equals_the_block_diagonal_sdpa_reference():
    """data.document_attention=varlen, the part that runs here: positions -> cu_seqlens and the [B, T] <-> [B*T]
    packing around torch's (CUDA-only) varlen_attn, with an SDPA loop over the segments standing in for it."""
    tokens, _, _ = packed_rows()
    positions = document_positions(tokens, EOD)
    cu = varlen_boundaries(positions)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 7, 19, 32, 32 + 1, 32 + 21, 32 + 26, 64]  # LENGTHS
    x = torch.arange(2 * 32 * 3).reshape(2, 32, 3)
    assert pack_batch(x)[32 + 5].tolist() == x[1, 5].tolist() and torch.equal(unpack_batch(pack_batch(x), 2), x)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 32, 4, 16, generator=g)
    k, v = torch.randn(2, 32, 2, 16, generator=g), torch.randn(2, 32, 2, 16, generator=g)  # GQA: 2 K/V heads
    model = tiny(2)
    cos, sin = model.rope.cos, model.rope.sin
    reference = DocumentMask.build(positions, cos, sin, "sdpa").attention(q, k, v, n_rep=2)
    mask = DocumentMask.build(positions, cos, sin, "varlen")
    assert torch.equal(mask.cu_seqlens, cu) and mask.mask is None
    rotated_q, rotated_k = apply_rope(q, mask.cos, mask.sin), apply_rope(k, mask.cos, mask.sin)
    packed = varlen_attention(rotated_q, rotated_k, v, mask.cu_seqlens, 2, kernel=segment_sdpa)
    assert packed.shape == reference.shape == (2, 32, 64)
    assert (packed - reference).abs().max() < 1e-6
    # controls: one boundary moved (a document cut a token late), or rows run on as one stream, miss by far
    moved = cu.clone()
    moved[2] += 1
    assert (varlen_attention(rotated_q, rotated_k, v, moved, 2, kernel=segment_sdpa) - reference).abs().max() > 1e-3
    rows_run_on = cu[cu != 32]
    wrong = varlen_attention(rotated_q, rotated_k, v, rows_run_on, 2, kernel=segment_sdpa)
    assert (wrong - reference)[1].abs().max() > 1e-3


def test_flops_count_each_documents_square_as_flop_counter_does_per_document():
    """The formula's attention term equals FlopCounterMode's count over the documents run alone (the work of
    exact block skipping); the SDPA reference on the packed rows computes (and is counted for) the full square."""
    model = tiny(2)
    cfg = model.cfg
    tokens, targets, spans = packed_rows()
    positions = document_positions(tokens, EOD)
    square_sum = sum((e - s) ** 2 for row in spans for s, e in row)
    assert document_square_sum(positions) == square_sum

    def counted(fn) -> int:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    per_document = sum(
        counted(lambda: F.cross_entropy(model(tokens[b : b + 1, s:e])[0], targets[b, s:e]).backward())
        for b, row in enumerate(spans)
        for s, e in row
    )
    assert per_document == 6 * matmul_params(cfg) * tokens.numel() + document_attention_flops(cfg, square_sum)
    assert document_flops_per_token(cfg, square_sum, tokens.numel()) * tokens.numel() == per_document
    packed = counted(
        lambda: F.cross_entropy(model(tokens, positions=positions).flatten(0, 1), targets.flatten()).backward()
    )
    assert packed == flops_per_token(cfg) * tokens.numel() > per_document  # the kernel's full square, not reported


def test_loader_emits_positions_from_megatron_samples_and_masks_the_loss_after_eod(data_cache):
    from data_support import make_stream

    from lmforge.data.loader import IGNORE_INDEX, BatchStream

    plain = make_stream(data_cache, {"books": 1}, 64, 16, 16, 1, 0, 512)
    mixture, plan = plain.mixture, plain.plan
    masked = BatchStream(
        mixture, plan, dp_rank=0, device=torch.device("cpu"), document_masking=True, loss_after_eod="mask"
    )
    eod, found = mixture.tokenizer.eod, 0
    for _ in range(32):  # chapters are ~3.7k tokens on average: a 64-token sample holds an EOD about 1 in 60
        (a,), (b,) = plain.step_batches(), masked.step_batches()
        assert a.positions is None and torch.equal(a.tokens[:, 1:], a.targets[:, :-1])  # the plain packed batch
        assert torch.equal(a.tokens, b.tokens)
        assert b.positions.tolist() == document_positions(a.tokens, eod).tolist()
        after_eod = a.tokens == eod
        found += int(after_eod.sum())
        assert torch.equal(b.targets, torch.where(after_eod, IGNORE_INDEX, a.targets))
        assert b.document_square_sum == document_square_sum(b.positions)
        assert (b.document_square_sum < b.tokens.numel() * b.tokens.shape[1]) == bool(after_eod[:, :-1].any())
        for row, pos in zip(a.tokens.tolist(), b.positions.tolist()):  # restarts exactly after each EOD
            assert [p == 0 for p in pos[1:]] == [t == eod for t in row[:-1]] and pos[0] == 0
    assert found >= 3, "the books corpus must put EODs inside these samples"


def test_validate_refuses_flex_and_varlen_where_they_cannot_train():
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate

    sizes = ["model=tiny", "train.micro_batch_size=2", "train.global_batch_size=8"]
    base = sizes + ["data.document_masking=true"]
    with pytest.raises(ConfigError, match="flex cannot train on the CPU: torch's FlexAttention has no backward"):
        validate(compose(base + ["data.document_attention=flex", "train.device=cpu"]), world_size=1)
    with pytest.raises(ConfigError, match="flex without parallelism.compile=true"):
        validate(compose(base + ["data.document_attention=flex", "train.device=cuda"]), world_size=1)
    with pytest.raises(ConfigError) as e:
        validate(compose(base + ["data.document_attention=varlen", "train.device=cpu"]), world_size=1)
    assert str(e.value) == (
        "config key 'data.document_attention': varlen cannot run on the CPU: torch's varlen_attn is a CUDA "
        "(flash attention) kernel. Fix: use data.document_attention=sdpa on the CPU (varlen needs CUDA and bf16)"
    )
    with pytest.raises(ConfigError) as e:
        validate(
            compose(base + ["data.document_attention=varlen", "train.device=cuda", "train.precision=fp32"]),
            world_size=1,
        )
    assert str(e.value) == (
        "config key 'data.document_attention': varlen needs bf16 activations (flash attention kernels have no fp32), "
        "not train.precision=fp32 with parallelism.param_dtype=fp32. Fix: set train.precision=bf16-mixed (or "
        "auto), or data.document_attention=sdpa"
    )
    # controls: the same settings that can run pass, and every pipeline layout takes document masking
    validate(
        compose(base + ["data.document_attention=flex", "train.device=cuda", "parallelism.compile=true"]), world_size=1
    )
    validate(compose(base + ["data.document_attention=varlen", "train.device=cuda"]), world_size=1)  # auto: bf16
    validate(
        compose(
            base
            + [
                "data.document_attention=varlen",
                "train.device=cuda",
                "train.precision=fp32",
                "parallelism=fsdp",
                "parallelism.param_dtype=bf16",
            ]
        ),
        world_size=2,
    )
    validate(compose(base + ["parallelism=ddp"]), world_size=2)
    for layout, world in (("pp2_zb", 2), ("cp2_pp2", 4)):  # pipelines take document masking (parity: distributed/)
        validate(compose(base + [f"parallelism={layout}"]), world_size=world)


def test_meter_uses_the_steps_own_flops_when_they_report_them():
    from lmforge.metrics.meter import IntervalMeter

    now = [0.0]
    meter = IntervalMeter(
        flops_per_token=100, peak_tflops_per_device=1.0, world_size=1, tokens_per_step=10**12, clock=lambda: now[0]
    )
    meter.start()
    for flops in (40.0, 60.0):  # two document-masked steps, one second each
        now[0] += 1.0
        meter.step_done(0.0, flops)
    assert meter.measure()["tflops_per_device"] == pytest.approx(50.0)  # their mean, not the unmasked 100
    now[0] += 1.0
    meter.step_done(0.0)  # control: a step that reports nothing uses the formula
    assert meter.measure()["tflops_per_device"] == pytest.approx(100.0)

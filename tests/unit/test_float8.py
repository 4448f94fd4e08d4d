"""Float8 training (train.precision=fp8, parallel/float8.py) on the CPU, in process.

torch's ``_scaled_mm`` runs on the CPU with float8_e4m3fn operands (tensorwise and rowwise scales), so torchao's
Float8Linear trains here: these tests check the conversion, the scaling logic and the checkpoint contract. They do
not check GPU numerics (no fast accumulation, no cuBLAS shape rules) or speed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torchao.float8.float8_linear as ao_linear
import yaml
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

from lmforge.checkpoint.state_io import DcpStateIO
from lmforge.config.model import ModelConfig, MoEConfig
from lmforge.config.schema import RootConfig
from lmforge.config.train import Float8Config
from lmforge.model.gpt import GPT, cross_entropy_loss
from lmforge.parallel import float8
from lmforge.parallel.float8 import (
    convert_to_float8,
    float8_fqns,
    float8_modules,
    float8_tp_style,
    gap_metrics,
    gap_warning,
    high_precision_linears,
    linear_count,
)
from lmforge.parallel.parallelize import parallelize
from lmforge.parallel.precision import autocast_context

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"
CPU = torch.device("cpu")
BASE = RootConfig()
# One block, small vocabulary: a 10-step curve in about a second per recipe on one CPU thread.
SMALL = ModelConfig(name="custom", vocab_size=256, d_model=64, n_layers=1, n_heads=4, seq_len=32)
# The curve's gradients are scaled down to a large batch's magnitude (AdamW is invariant to it): there the float8
# gradient underflows unless its dynamic scale lifts it, which the negative control removes.
GRAD_SCALE = 2.0**-14
CURVE_TOLERANCE = 0.05  # max |fp8 - bf16| loss over the 10 steps; measured 0.005 (tensorwise), 0.002 (rowwise)
BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2")
BLOCK += ("feed_forward.w3",)


def config(precision: str, **fp8) -> RootConfig:
    fp8 = replace(Float8Config(), **fp8)
    return replace(BASE, model=SMALL, train=replace(BASE.train, precision=precision, fp8=fp8))


def build(cfg: RootConfig, model_cfg: ModelConfig = SMALL) -> nn.Module:
    with torch.device("meta"):
        model = GPT(model_cfg)
    return parallelize(model, replace(cfg, model=model_cfg), None, CPU).model


def preset(name: str) -> ModelConfig:
    """A conf/model preset read from its file (its keys over the ModelConfig defaults)."""
    return ModelConfig(**yaml.safe_load((CONF / f"{name}.yaml").read_text()))


def meta_gpt(name: str) -> GPT:
    with torch.device("meta"):
        return GPT(preset(name))


def test_cpu_scaled_mm_runs_float8_e4m3_with_tensorwise_and_rowwise_scales():
    a = torch.randn(32, 64)
    b = torch.randn(48, 64)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    tensorwise = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32)
    rowwise = torch._scaled_mm(a8, b8, scale_a=torch.ones(32, 1), scale_b=torch.ones(1, 48), out_dtype=torch.float32)
    exact = a8.float() @ b8.float()
    assert torch.allclose(tensorwise, exact, rtol=1e-2, atol=1e-2)
    assert torch.allclose(rowwise, exact, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(exact, a @ b.t(), rtol=1e-3, atol=1e-3)  # control: e4m3 rounding is visible


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_model_tiny_converts_every_linear_but_the_head_only_when_the_shape_filter_is_off(capsys, recipe):
    tiny = meta_gpt("tiny")
    assert convert_to_float8(tiny, Float8Config(recipe=recipe), device=CPU, compiled=True) == []
    assert "0 of 28 linears in float8" in capsys.readouterr().out  # torchao's thresholds skip every tiny linear
    names = convert_to_float8(tiny, Float8Config(recipe=recipe, shape_filter=False), device=CPU, compiled=True)
    converted = list(float8_modules(tiny))
    assert len(converted) == len(names) == linear_count(tiny) == 7 * 4 > 0
    granularity = {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    assert all(m.config.cast_config_input.scaling_granularity.value == granularity for m in converted)
    assert type(tiny.output).__name__ == "OutputHead"  # the head is lmforge's own module and stays bf16


def test_fp8_without_compile_warns_once(capsys, monkeypatch):
    monkeypatch.setattr(float8, "_warned", set())  # as in a fresh process
    for _ in range(2):
        build(config("fp8", shape_filter=False))
    out = capsys.readouterr().out
    assert out.count("lmforge: warning: train.precision=fp8 without parallelism.compile=true") == 1
    assert out.count("7 of 7 linears in float8") == 2


def test_conversion_keeps_every_state_dict_name_and_dtype():
    plain = build(config("bf16-mixed")).state_dict()
    fp8 = build(config("fp8", shape_filter=False))
    assert any(True for _ in float8_modules(fp8))
    state = fp8.state_dict()
    assert list(state) == list(plain)
    assert {k: v.dtype for k, v in state.items()} == {k: v.dtype for k, v in plain.items()}
    assert all(torch.equal(state[k], plain[k]) for k in plain)  # same name-keyed init
    assert "layers.0.attention.wq.weight" in state


def test_the_shape_filter_at_gpt_1b_and_gpt_7b():
    layer = lambda names: sorted({n.split(".", 2)[2] for n in names})  # noqa: E731
    gpt_1b = meta_gpt("gpt_1b")
    tensorwise = float8_fqns(gpt_1b, Float8Config(recipe="tensorwise"))
    # wk/wv (2048 -> 1024) are below tensorwise's threshold (K <= 4096 and N <= 1024)
    assert layer(tensorwise) == sorted(set(BLOCK) - {"attention.wk", "attention.wv"})
    assert len(tensorwise) == 5 * 24
    # rowwise keeps every GEMM with N <= 2048 (and N <= 4096 with K <= 2048) in bf16: only w1/w3 (2048 -> 5504)
    assert layer(float8_fqns(gpt_1b, Float8Config(recipe="rowwise"))) == ["feed_forward.w1", "feed_forward.w3"]
    gpt_7b = meta_gpt("gpt_7b")
    for recipe in ("tensorwise", "rowwise"):
        names = float8_fqns(gpt_7b, Float8Config(recipe=recipe))
        assert layer(names) == sorted(BLOCK) and len(names) == 7 * 32
    no_attention = float8_fqns(gpt_7b, Float8Config(filter_fqns=["attention"]))
    assert layer(no_attention) == ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    assert not any(n.endswith("output") for n in float8_fqns(gpt_7b, Float8Config(shape_filter=False)))


def test_the_moe_router_never_converts_and_the_shared_experts_do():
    moe = replace(SMALL, moe=MoEConfig(experts=16, top_k=2, shared_experts=1))
    with torch.device("meta"):
        names = float8_fqns(GPT(moe), Float8Config(shape_filter=False))
    assert "layers.0.feed_forward.router.gate" not in names
    assert {"layers.0.feed_forward.shared.w1", "layers.0.attention.wq"} <= set(names)


def curve(precision: str, recipe: str = "tensorwise", steps: int = 10) -> list:
    torch.manual_seed(0)
    model = build(config(precision, recipe=recipe, shape_filter=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-30)
    tokens = torch.randint(0, SMALL.vocab_size, (4, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        with autocast_context(precision, CPU):
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        (loss * GRAD_SCALE).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def unscaled_grad_output(real):
    """torchao's cast with the gradient's scale forced to 1: small gradients underflow in float8."""

    def cast(hp, float8_dtype, linear_mm_config, *args, gemm_input_role=GemmInputRole.INPUT, **kwargs):
        out = real(hp, float8_dtype, linear_mm_config, *args, gemm_input_role=gemm_input_role, **kwargs)
        if gemm_input_role != GemmInputRole.GRAD_OUTPUT:
            return out
        one = torch.ones_like(out._scale)
        return hp_tensor_and_scale_to_float8(
            hp, one, float8_dtype, linear_mm_config, gemm_input_role, out._axiswise_dim
        )

    return cast


@pytest.fixture(scope="module")
def bf16_curve():
    torch.set_num_threads(1)
    return curve("bf16-mixed")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_loss_curve_stays_within_tolerance_of_bf16(bf16_curve, recipe):
    fp8 = curve("fp8", recipe)
    assert bf16_curve[-1] < bf16_curve[0] - 1.0  # it trains
    assert max(abs(a - b) for a, b in zip(fp8, bf16_curve)) < CURVE_TOLERANCE


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_negative_control_an_unscaled_gradient_leaves_the_tolerance(bf16_curve, monkeypatch, recipe):
    monkeypatch.setattr(
        ao_linear, "hp_tensor_to_float8_dynamic", unscaled_grad_output(ao_linear.hp_tensor_to_float8_dynamic)
    )
    fp8 = curve("fp8", recipe)
    assert max(abs(a - b) for a, b in zip(fp8, bf16_curve)) > 5 * CURVE_TOLERANCE


def test_high_precision_linears_are_the_bf16_forward_of_the_same_weights():
    fp8_model, plain = build(config("fp8", shape_filter=False)), build(config("bf16-mixed"))
    tokens = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len + 1), generator=torch.Generator().manual_seed(2))

    def loss(model):
        with torch.no_grad(), autocast_context("fp8", CPU):
            return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])

    with high_precision_linears(fp8_model) as swapped:
        bf16 = loss(fp8_model)
    assert swapped == 7 and torch.equal(bf16, loss(plain))
    assert len(list(float8_modules(fp8_model))) == 7  # restored
    metrics = {k: float(v) for k, v in gap_metrics(loss(fp8_model), bf16).items()}
    assert 0 < abs(metrics["fp8/loss_gap"]) < 0.05
    assert gap_warning(metrics, 0.05, step=10) is None
    warning = gap_warning({**metrics, "fp8/loss_gap": 0.2}, 0.05, step=10)
    assert warning.startswith("fp8 numerics at step 10: the check batch's float8 loss")
    assert "by +0.2000 (train.fp8.check_tolerance=0.05)" in warning


@pytest.mark.parametrize("saved, loaded", [("fp8", "bf16-mixed"), ("bf16-mixed", "fp8")])
def test_a_checkpoint_moves_between_fp8_and_bf16_mixed(tmp_path, saved, loaded):
    source = build(config(saved, shape_filter=False))
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.5)  # not the init: the load must bring these values
    DcpStateIO(source).save(tmp_path, FileSystemWriter(tmp_path))
    target = build(config(loaded, shape_filter=False))
    DcpStateIO(target).load(tmp_path, {"world_size": 1})
    a, b = source.state_dict(), target.state_dict()
    assert list(a) == list(b)
    assert all(a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)
    assert any(True for _ in float8_modules(source if saved == "fp8" else target))


def test_tensor_parallel_styles_of_converted_linears():
    """tensorwise: a converted linear's Colwise / RowwiseParallel becomes torchao's float8 style with the same layouts
    (what tensor_parallel.apply_tensor_parallel plans without sequence parallelism); rowwise, an unconverted linear or
    another style keeps the planned style."""

    def converted(recipe: str) -> nn.Module:
        model = nn.Sequential(nn.Linear(32, 32, bias=False))
        convert_to_float8(model, Float8Config(recipe=recipe, shape_filter=False), device=CPU, compiled=True)
        return model[0]

    colwise, rowwise = ColwiseParallel(), RowwiseParallel(output_layouts=Shard(1))
    tensorwise = converted("tensorwise")
    col8, row8 = float8_tp_style(colwise, tensorwise), float8_tp_style(rowwise, tensorwise)
    assert type(col8) is Float8ColwiseParallel and type(row8) is Float8RowwiseParallel
    assert (col8.input_layouts, col8.output_layouts, col8.use_local_output) == ((Replicate(),), (Shard(-1),), True)
    assert (row8.input_layouts, row8.output_layouts) == ((Shard(-1),), (Shard(1),))
    assert float8_tp_style(colwise, converted("rowwise")) is colwise
    assert float8_tp_style(colwise, nn.Linear(32, 32)) is colwise
    norm_style = SequenceParallel()
    assert float8_tp_style(norm_style, tensorwise) is norm_style

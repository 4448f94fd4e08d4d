"""Host dispatch time in the step model: ops counted on the meta device, seconds per op measured on a CPU, all of
it on the CPU's critical path and only the part beyond the kernels on a GPU."""

from __future__ import annotations

import time

import pytest

from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.parallel.device_table import HOST_OP_OVERHEAD_GPU_S, device_spec
from lmforge.parallel.host_overhead import (
    OPTIMIZER_OPS,
    eager_block_bytes,
    least_disturbed_s,
    measure_loss_rate,
    measure_op_overhead,
    ops_per_micro_batch,
)
from lmforge.parallel.planner import make_plan
from lmforge.parallel.step_model import ELEMENTWISE_D, ELEMENTWISE_F, LOSS_FORWARD_SHARE, block_pass


def _tiny(*extra):
    return validate(compose(["model=tiny", "cluster.device=cpu", "train.precision=fp32", *extra]), world_size=1)


def test_ops_are_counted_per_block_and_do_not_depend_on_the_sizes():
    block, rest = ops_per_micro_batch(_tiny().cfg, 8)
    assert 100 < block < 1000 and rest > 0
    wide = _tiny("model.d_model=128", "model.n_heads=4")
    assert ops_per_micro_batch(wide.cfg, 8)[0] == block  # same block, other widths: same ops
    gelu = _tiny("model.mlp=gelu", "model.norm=layernorm")
    assert ops_per_micro_batch(gelu.cfg, 8)[0] != block  # another block: counted again


def test_cpu_step_pays_every_op_and_a_gpu_hides_them_under_its_kernels():
    cfg = _tiny()
    slow_host = device_spec("cpu", cpu_tflops=0.02, cpu_gbps=5.0, cpu_op_s=20e-6)
    no_host = device_spec("cpu", cpu_tflops=0.02, cpu_gbps=5.0)
    with_host, without = make_plan(cfg, 1, device=slow_host), make_plan(cfg, 1, device=no_host)
    block, rest = ops_per_micro_batch(cfg.cfg, cfg.plan.micro_batch_size)
    ops = cfg.plan.grad_accum * (cfg.cfg.model.n_layers * block + rest) + OPTIMIZER_OPS
    assert with_host.step.host_s == pytest.approx(ops * 20e-6)
    assert with_host.step_time_s == pytest.approx(without.step_time_s + ops * 20e-6)
    assert without.step.host_s == 0
    assert device_spec("h100").op_overhead_s == HOST_OP_OVERHEAD_GPU_S
    big = validate(compose(["model=gpt_1b", "cluster.device=h100", "train.micro_batch_size=8"]), world_size=1)
    assert make_plan(big, 1).step.host_s == 0  # its kernels outlast the host's dispatch
    small = validate(compose(["model=tiny", "cluster.device=h100"]), world_size=1)
    step = make_plan(small, 1).step
    block, rest = ops_per_micro_batch(small.cfg, small.plan.micro_batch_size)
    host = (small.plan.grad_accum * (4 * block + rest) + OPTIMIZER_OPS) * HOST_OP_OVERHEAD_GPU_S
    assert step.host_s == pytest.approx(host - (step.total_s - step.host_s))  # only what exceeds the kernels


def test_op_overhead_is_measured_in_microseconds():
    seconds = measure_op_overhead(chain=50, repeats=3)
    assert 1e-7 < seconds < 1e-3


def test_a_cpu_loss_takes_its_logits_over_the_measured_loss_rate_a_quarter_of_it_forward():
    cfg = _tiny()
    logits = cfg.plan.grad_accum * cfg.plan.micro_batch_size * cfg.cfg.model.seq_len * cfg.cfg.model.vocab_size
    rate = 1e6  # logits per second: slow enough that the loss, not its bytes, binds
    bytes_only = make_plan(cfg, 1, device=device_spec("cpu", cpu_tflops=0.02, cpu_gbps=5.0))
    measured = make_plan(cfg, 1, device=device_spec("cpu", cpu_tflops=0.02, cpu_gbps=5.0, cpu_loss_rate=rate))
    bytes_s = logits * 16 / 5e9  # LOSS_BYTES_PER_LOGIT over the copy bandwidth, forward + backward
    assert measured.step_time_s - bytes_only.step_time_s == pytest.approx(logits / rate - bytes_s, rel=1e-6)
    assert LOSS_FORWARD_SHARE == 0.25
    # Negative control: a loss rate faster than the bytes leaves the bytes' time.
    quick = make_plan(cfg, 1, device=device_spec("cpu", cpu_tflops=0.02, cpu_gbps=5.0, cpu_loss_rate=1e15))
    assert quick.step_time_s == pytest.approx(bytes_only.step_time_s)
    assert 1e5 < measure_loss_rate(64, 512, repeats=1) < 1e12


def test_least_disturbed_time_is_the_threads_cpu_time_and_the_minimum_of_the_repeats():
    calls = []

    def work():
        calls.append(1)
        sum(range(20000 * len(calls)))  # each call longer than the one before: the first timed one is the least

    first = least_disturbed_s(work, repeats=4)
    assert len(calls) == 5  # one warm-up, four timed
    calls.clear()
    calls.append(1)  # the next call does the work of the first timed one above, alone
    t0 = time.thread_time()
    work()
    assert first == pytest.approx(time.thread_time() - t0, rel=0.5)
    t0 = time.thread_time()
    time.sleep(0.05)  # waiting holds no CPU: a shared host's other processes do not count
    assert time.thread_time() - t0 < 0.01


def test_eager_block_bytes_count_every_unfused_element_wise_op_of_a_block():
    cfg = _tiny().cfg
    fwd, bwd = eager_block_bytes(cfg, 8)
    n, d, f = 8 * cfg.model.seq_len, cfg.model.d_model, 192  # tiny's SwiGLU width (8/3 d rounded up to 64)
    fused = n * (ELEMENTWISE_D * d + ELEMENTWISE_F["swiglu"] * f) * 4  # the fused kernels' bytes a GPU table counts
    assert 1.5 * fused < fwd < 4 * fused  # eager: every norm, rotary and activation op through memory on its own
    assert bwd > fwd
    # bytes scale with the tokens (but for a few weight-sized reads)
    assert eager_block_bytes(cfg, 16) == pytest.approx((2 * fwd, 2 * bwd), rel=0.01)
    # the attention core is one fused op, not the meta device's math (a softmax over seq x seq): the same tokens in
    # sequences twice as long move the same element-wise bytes
    longer = _tiny("model.seq_len=128").cfg
    assert eager_block_bytes(longer, 4) == pytest.approx((fwd, bwd), rel=0.05)


def test_a_cpu_block_moves_its_eager_bytes_and_a_gpu_block_its_fused_bytes():
    cfg = _tiny()
    cpu = device_spec("cpu", cpu_tflops=0.05, cpu_gbps=10.0)
    block = block_pass(cfg.cfg, cpu, 8, moe=False, dtype="fp32", e=4, r=4)
    fwd, bwd = eager_block_bytes(cfg.cfg, 8)
    assert block.fwd_elementwise == pytest.approx(fwd / 10e9)
    assert block.bwd_elementwise == pytest.approx(bwd / 10e9)
    h100 = device_spec("h100")
    assert not h100.eager_elementwise  # negative control: a GPU keeps the fused kernels' bytes
    gpu = block_pass(cfg.cfg, h100, 8, moe=False, dtype="bf16", e=2, r=4)
    assert gpu.bwd_elementwise == pytest.approx(2 * gpu.fwd_elementwise)

"""Host dispatch time in the step model: ops counted on the meta device, seconds per op measured on a CPU, all of
it on the CPU's critical path and only the part beyond the kernels on a GPU."""

from __future__ import annotations

import pytest

from lmforge.config.compose import compose
from lmforge.config.validate import validate
from lmforge.parallel.device_table import HOST_OP_OVERHEAD_GPU_S, device_spec
from lmforge.parallel.host_overhead import OPTIMIZER_OPS, measure_loss_rate, measure_op_overhead, ops_per_micro_batch
from lmforge.parallel.planner import make_plan
from lmforge.parallel.step_model import LOSS_FORWARD_SHARE


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

"""benchmarks/profile_step.py's bucketing on one real profiled engine step of the tiny model: every GEMM and
attention FLOP is found (the totals equal the project's FLOPs formula), RoPE's and the loss's ops (forward
and backward) land in their own categories by context, and without the context rules (the negative control)
RoPE disappears into "other ops". Keeps the profile table from silently rotting as the model code changes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.profile_step import (  # noqa: E402
    CATEGORIES,
    Breakdown,
    ProfileRun,
    bucket,
    op_category,  # noqa: E402
    profile_steps,
    table,
)
from benchmarks.step import base_overrides, engine_step  # noqa: E402
from lmforge.config.compose import compose  # noqa: E402
from lmforge.config.validate import validate  # noqa: E402
from lmforge.model.flops import attention_flops_per_token, matmul_params  # noqa: E402


def test_one_step_is_bucketed_by_op_and_context():
    was_initialized = dist.is_initialized()
    batch = 2
    base = base_overrides("tiny", batch)
    cfg = validate(compose(base), world_size=1).cfg.model
    try:
        step = engine_step(base, batch)
        step()
        events = list(profile_steps(step, 1).events())
    finally:
        if not was_initialized and dist.is_initialized():
            dist.destroy_process_group()
    b = bucket(events, step_s=1.0)
    tokens = batch * cfg.seq_len
    assert b.steps == 1 and set(b.self_us) <= set(CATEGORIES)
    assert sum(b.share(c) for c in CATEGORIES) == pytest.approx(1.0)
    # Every GEMM and attention op was found, forward and backward (6N and the full-square attention term).
    assert b.flops["GEMM"] == 6 * matmul_params(cfg) * tokens
    assert b.flops["attention"] == attention_flops_per_token(cfg) * tokens
    for category in ("GEMM", "attention", "norms", "activations", "RoPE", "loss", "optimizer"):
        assert b.self_us.get(category, 0) > 0, category
    assert not {"aten::addcmul_", "aten::_log_softmax"} & set(b.other_ops)
    # The chunked loss's own ops, forward and (custom autograd Function) backward, are the loss.
    assert not {"aten::logsumexp", "aten::gather", "aten::exp_", "aten::scatter_add_"} & set(b.other_ops)
    # Negative control: without the context rules RoPE's ops (mul/addcmul_, forward and backward) are "other".
    blind = bucket(events, step_s=1.0, use_context=False)
    assert blind.self_us.get("RoPE", 0) == 0 and "aten::addcmul_" in blind.other_ops
    assert blind.self_us["other ops"] > b.self_us.get("other ops", 0)


def test_compiled_kernel_names_and_view_ops():
    assert op_category("graph_0_cpp_fused_add_native_layer_norm_3") == "norms"
    assert op_category("graph_1_cpp_fused_gelu_mul_5") == "activations"
    assert op_category("graph_0_cpp_fused__unsafe_view_add_flip_lift_fresh_mul_unsqueeze_view_1") == "RoPE"
    assert op_category("aten::mm") == "GEMM" and op_category("aten::view") is None
    assert op_category("aten::embedding") == "other ops"


def test_paired_ratios_cancel_the_machine_drift_between_rounds():
    from benchmarks.step import paired_ratios

    # Round 2 runs on a machine twice as slow: the step and the GEMM probe both take twice as long.
    steps, gemms = [1.0, 2.0, 1.25], [0.8, 1.6, 0.8]
    paired = paired_ratios(steps, gemms, flops=90.0, gemm_flops=80.0)
    assert paired == pytest.approx([0.9, 0.9, 0.72])
    # Negative control: the ratio of the medians mixes rounds (a slow step with a fast probe) and differs.
    import statistics

    assert (90.0 / statistics.median(steps)) / (80.0 / statistics.median(gemms)) != pytest.approx(0.9)


def test_ceiling_counts_only_gemm_and_attention_time():
    # Two profiled steps: GEMMs do 80 flops a step in 1.0 s (the probe would take 0.8 s), attention 0.2 s,
    # everything else 0.5 s; the model does 90 flops a step.
    b = Breakdown(
        wall_us=2 * 1.7e6,
        steps=2,
        self_us={"GEMM": 2.0e6, "attention": 0.4e6, "norms": 1.0e6},
        flops={"GEMM": 160.0, "attention": 10.0},
    )
    run = ProfileRun("m", "eager", b, step_s=1.7, gemm_rate=100.0, model_flops=90.0)
    assert run.ceiling() == pytest.approx(90.0 / (0.8 + 0.2) / 100.0)  # 0.9
    assert run.ceiling(gemm_at_probe=False) == pytest.approx(90.0 / (1.0 + 0.2) / 100.0)  # 0.75
    assert run.model_flops / run.step_s / run.gemm_rate < run.ceiling(gemm_at_probe=False)  # the step is below
    # The other categories do not move it (norms 5x slower: same ceilings); attention does.
    slow_norms = Breakdown(b.wall_us, 2, {**b.self_us, "norms": 5.0e6}, b.flops)
    assert ProfileRun("m", "eager", slow_norms, 3.7, 100.0, 90.0).ceiling() == pytest.approx(run.ceiling())
    slow_attention = Breakdown(b.wall_us, 2, {**b.self_us, "attention": 0.8e6}, b.flops)
    assert ProfileRun("m", "eager", slow_attention, 1.9, 100.0, 90.0).ceiling() == pytest.approx(90.0 / 1.2 / 100.0)
    rows = table([run]).splitlines()
    assert "| ceiling: GEMM at the probe rate, attention as measured, the rest 0 | 90% of GEMM |" in rows
    assert "| ceiling: GEMM and attention as measured, the rest 0 | 75% of GEMM |" in rows

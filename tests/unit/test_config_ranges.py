"""Number fields state their range in their annotation; validate() refuses a value outside it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.ranges import Range, check_ranges, range_fields
from lmforge.config.schema import RootConfig
from lmforge.config.validate import validate

POSITIVE = {
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.seq_len", "model.ffn_multiple_of",
    "model.mup_base_width", "model.mup_base_head_dim",
    "parallelism.dp_replicate", "parallelism.dp_shard", "parallelism.cp", "parallelism.ep", "parallelism.tp",
    "parallelism.pp", "parallelism.pp_virtual_stages", "train.max_steps", "train.micro_batch_size",
    "train.global_batch_size", "train.eval_batches", "cluster.nodes", "cluster.gpus_per_node",
    "logging.every_steps", "checkpoint.keep_last", "fault.replica_groups", "fault.replica_min",
}  # fmt: skip
NON_NEGATIVE = {
    "optim.lr", "optim.weight_decay", "optim.grad_clip", "optim.warmup_steps", "optim.eps", "train.threads",
    "train.eval_every", "train.planned_tokens", "checkpoint.every_steps", "checkpoint.keep_every",
    "metrics.profile_every", "metrics.straggler_every", "parallelism.pp_microbatches", "data.num_workers",
    "cluster.cpus_per_task", "data.max_epochs", "fault.consistency_every", "fault.drill.bitflip_step",
    "cluster.gemm_tflops", "parallelism.recompute_layers", "train.fp8.check_every", "optim.decay_steps",
    "fault.exclude_straggler_flags", "cluster.min_nodes", "train.batch_size_schedule.start",
    "train.batch_size_schedule.increment", "train.batch_size_schedule.ramp_samples", "train.seq_len_schedule.start",
    "train.seq_len_schedule.warmup_samples", "fault.replica_id",
}  # fmt: skip


def test_the_ranged_keys():
    ranges = dict(range_fields(RootConfig))
    assert {k for k, r in ranges.items() if str(r) == ">= 1"} == POSITIVE
    assert {k for k, r in ranges.items() if str(r) == ">= 0"} == NON_NEGATIVE
    assert {k: str(r) for k, r in ranges.items() if k not in POSITIVE | NON_NEGATIVE} == {
        "data.valid_fraction": "in (0, 1)",
        "optim.min_lr_ratio": "in [0, 1]",
        "train.fp8.check_tolerance": "> 0",
        "fault.replica_timeout_s": "> 0",
        "fault.replica_quorum_timeout_s": "> 0",
    }


def test_open_and_closed_ends():
    r = Range(0, 1, low_open=True)
    assert [r.holds(v) for v in (0.0, 1e-9, 1.0, 1.0 + 1e-9)] == [False, True, True, False]
    assert Range(1).holds(10**9) and not Range(1).holds(0)


def with_value(key, value):
    cfg = RootConfig()
    section, name = key.rsplit(".", 1)
    parents = section.split(".")
    nodes = [cfg]
    for part in parents:
        nodes.append(getattr(nodes[-1], part))
    new = replace(nodes[-1], **{name: value})
    for node, part in zip(reversed(nodes[:-1]), reversed(parents)):
        new = replace(node, **{part: new})
    return new


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.n_layers", 0, "config key 'model.n_layers': must be >= 1, got 0. Fix: set a positive value"),
        ("optim.lr", -1.0, "config key 'optim.lr': must be >= 0, got -1.0. Fix: set a value >= 0"),
        (
            "fault.drill.bitflip_step",
            -1,
            "config key 'fault.drill.bitflip_step': must be >= 0, got -1. Fix: set a value >= 0",
        ),
        ("optim.min_lr_ratio", 1.5, "config key 'optim.min_lr_ratio': must be in [0, 1], got 1.5. Fix: e.g. 0.1"),
        (
            "cluster.gemm_tflops",
            -1.0,
            "config key 'cluster.gemm_tflops': must be >= 0, got -1.0. Fix: set a value >= 0",
        ),
        ("data.valid_fraction", 1.0, "config key 'data.valid_fraction': must be in (0, 1), got 1.0. Fix: e.g. 0.02"),
    ],
)
def test_a_value_outside_its_range_is_refused(key, value, message):
    with pytest.raises(ConfigError) as e:
        check_ranges(with_value(key, value))
    assert str(e.value) == message
    check_ranges(RootConfig())  # control: the defaults are in range


def test_validate_checks_the_ranges():
    with pytest.raises(ConfigError) as e:
        validate(compose(["checkpoint.keep_last=0"]))
    assert str(e.value) == "config key 'checkpoint.keep_last': must be >= 1, got 0. Fix: set a positive value"

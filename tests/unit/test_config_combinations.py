"""The refused feature combinations: one table, walked by validate() and listed by docs/configuration.md."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import pytest

from lmforge.config.combinations import REFUSED, check_combinations, docs_rows
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig
from lmforge.config.validate import validate

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# One configuration per row of REFUSED, in its order: (parallelism fields, model fields[, train fields[, optim
# fields[, checkpoint fields[, fault fields[, data fields]]]]]); a train example's "fp8" entry holds train.fp8 fields,
# its "batch_size_schedule" and "seq_len_schedule" entries those schedules' fields.
EXAMPLES = [
    ({"recompute_modules": ["mlp"]}, {}),
    ({"activation_checkpointing": "modules", "recompute_modules": ["attn"]}, {}),
    ({"recompute_layers": 2}, {}),
    ({"selective_matmuls": "alternate"}, {}),
    ({"activation_checkpointing": "modules", "cp": 2}, {}),
    ({"sequence_parallel": True}, {}),
    ({"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "1F1B"}, {}),
    ({"pp": 2, "pp_schedule": "ZBVZeroBubble"}, {}),
    ({"pp": 2}, {}),
    ({}, {"parametrization": "mup"}),
    (
        {"pp": 2, "pp_schedule": "InterleavedZeroBubble", "pp_virtual_stages": 2, "compile": True},
        {"tie_embeddings": False},
    ),
    (
        {"pp": 2, "pp_schedule": "InterleavedZeroBubble", "pp_virtual_stages": 2, "dp_shard": 2},
        {"tie_embeddings": False},
    ),
    ({"tp": 2, "compile": True}, {}),
    ({"fsdp_grad_sync": "every_microbatch"}, {}),
    ({"engine": "deepspeed", "tp": 2}, {}),
    ({"dp_shard": 2, "param_dtype": "bf16"}, {}, {"precision": "bf16-mixed", "fp32_residual": True}),
    ({}, {}, {"precision": "bf16-mixed", "fp8": {"check_every": 10}}),
    ({"engine": "deepspeed"}, {}, {"precision": "fp8"}),
    ({"dp_shard": 2}, {}, {"precision": "fp8", "fp8": {"recipe": "rowwise", "enable_fsdp_float8_all_gather": True}}),
    ({}, {}, {"precision": "fp8", "fp8": {"enable_fsdp_float8_all_gather": True}}),
    ({"dp_shard": 2}, {}, {"precision": "fp8", "fp8": {"check_every": 5, "enable_fsdp_float8_all_gather": True}}),
    ({}, {}, {}, {"schedule": "cosine", "decay_shape": "1-sqrt"}),
    ({}, {}, {"max_steps": 100}, {"schedule": "wsd", "warmup_steps": 10, "decay_steps": 91}),
    ({}, {}, {"max_steps": 100}, {}, {"at_steps": [40, 101]}),
    (
        {"engine": "deepspeed"},
        {},
        {"global_batch_size": 32, "batch_size_schedule": {"start": 8, "increment": 8, "ramp_samples": 64}},
    ),
    (
        {"pp": 2},
        {"tie_embeddings": False},
        {"global_batch_size": 32, "batch_size_schedule": {"start": 8, "increment": 8, "ramp_samples": 64}},
    ),
    (
        {},
        {},
        {
            "global_batch_size": 32,
            "grad_accum": 4,
            "batch_size_schedule": {"start": 8, "increment": 8, "ramp_samples": 64},
        },
    ),
    ({"pp": 2}, {"tie_embeddings": False}, {"seq_len_schedule": {"start": 64, "warmup_samples": 64}}),
    ({"tp": 2, "cp": 2}, {}, {}, {}, {}, {"replica_ft": "torchft", "replica_groups": 3, "replica_min": 2}),
    ({}, {}, {}, {}, {}, {"replica_ft": "torchft", "replica_groups": 2, "replica_id": 2, "replica_min": 2}),
    ({}, {}, {}, {}, {}, {"replica_ft": "torchft", "replica_groups": 4, "replica_min": 2}),
    ({}, {}, {}, {}, {}, {"replica_ft": "torchft", "spike_factor": 3.0}),
    ({}, {}, {}, {}, {}, {"replica_ft": "torchft"}, {"num_workers": 2}),
    (
        {},
        {},
        {"global_batch_size": 32, "batch_size_schedule": {"start": 8, "increment": 8, "ramp_samples": 64}},
        {},
        {},
        {"replica_ft": "torchft", "replica_groups": 3, "replica_min": 2},
    ),
]


def example_config(
    par: dict,
    model: dict,
    train: Optional[dict] = None,
    optim: Optional[dict] = None,
    checkpoint: Optional[dict] = None,
    fault: Optional[dict] = None,
    data: Optional[dict] = None,
) -> RootConfig:
    base = RootConfig()
    train = dict(train or {})
    fp8 = replace(base.train.fp8, **train.pop("fp8", {}))
    ramp = replace(base.train.batch_size_schedule, **train.pop("batch_size_schedule", {}))
    warmup = replace(base.train.seq_len_schedule, **train.pop("seq_len_schedule", {}))
    return replace(
        base,
        parallelism=replace(base.parallelism, **par),
        model=replace(base.model, **model),
        train=replace(base.train, fp8=fp8, batch_size_schedule=ramp, seq_len_schedule=warmup, **train),
        optim=replace(base.optim, **(optim or {})),
        checkpoint=replace(base.checkpoint, **(checkpoint or {})),
        fault=replace(base.fault, **(fault or {})),
        data=replace(base.data, **(data or {})),
    )


def test_every_row_has_an_example():
    assert len(EXAMPLES) == len(REFUSED)


@pytest.mark.parametrize("row, example", list(zip(REFUSED, EXAMPLES)), ids=[r.key for r in REFUSED])
def test_each_row_refuses_its_combination(row, example):
    cfg = example_config(*example)
    with pytest.raises(ConfigError) as e:
        check_combinations(cfg)
    assert str(e.value) == str(ConfigError(row.key, row.reason(cfg), row.fix))
    check_combinations(RootConfig())  # control: the defaults combine


def test_validate_walks_the_table():
    with pytest.raises(ConfigError) as e:
        validate(compose(["parallelism=tp2", "parallelism.compile=true"]), world_size=2)
    assert str(e.value).startswith("config key 'parallelism.compile': torch.compile of tensor-parallel blocks fails")


def test_the_docs_list_the_table():
    text = DOCS.read_text()
    listed = re.search(r"\n(\| refused combination \|.*?)\n\n", text, re.S)
    assert listed, "docs/configuration.md lacks the table of refused combinations"
    assert listed.group(1).split("\n") == docs_rows()


def test_fp8_rowwise_with_the_float8_all_gather_names_both_keys():
    with pytest.raises(ConfigError) as e:
        validate(
            compose(
                [
                    "parallelism=fsdp",
                    "train.precision=fp8",
                    "train.fp8.recipe=rowwise",
                    "train.fp8.enable_fsdp_float8_all_gather=true",
                ]
            ),
            world_size=2,
        )
    assert str(e.value) == (
        "config key 'train.fp8.enable_fsdp_float8_all_gather': the float8 all-gather needs one scale per weight "
        "tensor: train.fp8.recipe=tensorwise. Fix: set train.fp8.recipe=tensorwise or "
        "train.fp8.enable_fsdp_float8_all_gather=false"
    )
    # control: the tensorwise recipe with the float8 all-gather validates
    validate(
        compose(
            [
                "parallelism=fsdp",
                "train.micro_batch_size=4",
                "train.precision=fp8",
                "train.fp8.enable_fsdp_float8_all_gather=true",
            ]
        ),
        world_size=2,
    )

"""The DeepSpeed config is generated from the Hydra config; a user JSON may add keys, never contradict."""

from __future__ import annotations

import json

import pytest

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import check_batch, validate
from lmforge.parallel.deepspeed_config import build_config


def ds(overrides, precision="fp32", world=2):
    cfg = validate(compose(["model=tiny", "train.micro_batch_size=4", *overrides]), world_size=world)
    return build_config(cfg, check_batch(cfg), precision)


def test_presets_map_batch_precision_clipping_and_zero_keys():
    c = ds(
        [
            "parallelism=zero3_offload",
            "train.micro_batch_size=2",
            "train.global_batch_size=16",
            "optim.grad_clip=0.7",
            "parallelism.ddp_bucket_cap_mb=4",
        ],
        precision="bf16-mixed",
    )
    assert (c["train_batch_size"], c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (16, 2, 4)
    assert c["gradient_clipping"] == 0.7 and c["bf16"] == {"enabled": True} and c["fp16"] == {"enabled": False}
    z = c["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z
    assert z["overlap_comm"] is True and z["contiguous_gradients"] is True
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 4 * 2**20 // 4
    assert "optimizer" not in c and "scheduler" not in c  # lmforge's AdamW and LR schedule
    for stage in (1, 2, 3):
        assert ds([f"parallelism=zero{stage}"])["zero_optimization"]["stage"] == stage
    assert (
        ds(["parallelism=zero2", "parallelism.overlap_grad_reduce=false"])["zero_optimization"]["overlap_comm"] is False
    )


def test_user_json_adds_keys_and_auto_defers_to_hydra(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 12345},
            }
        )
    )
    c = ds(["parallelism=zero3", "train.micro_batch_size=4", f"parallelism.deepspeed_config={user}"])
    assert c["train_batch_size"] == 8 and c["zero_optimization"]["stage3_prefetch_bucket_size"] == 12345
    assert c["zero_optimization"]["stage"] == 3 and c["zero_optimization"]["overlap_comm"] is True


def test_user_json_conflict_names_both_values(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}))
    with pytest.raises(ConfigError) as e:
        ds(["parallelism=zero3", "train.micro_batch_size=4", f"parallelism.deepspeed_config={user}"])
    msg = str(e.value)
    assert "parallelism.deepspeed_config" in msg
    assert "train_micro_batch_size_per_gpu = 16" in msg and "train.micro_batch_size gives 4" in msg
    assert "zero_optimization.stage = 2" in msg and "parallelism.zero_stage gives 3" in msg


def test_user_json_optimizer_section_refused(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    with pytest.raises(ConfigError, match="sets 'optimizer', which lmforge owns through optim"):
        ds(["parallelism=zero1", f"parallelism.deepspeed_config={user}"])


def test_bad_offload_and_missing_file_fail_fast(tmp_path):
    with pytest.raises(ConfigError, match="parameter offload needs zero_stage=3, got 2"):
        ds(["parallelism=zero2", "parallelism.offload_params=cpu"])
    with pytest.raises(ConfigError, match="does not exist"):
        ds(["parallelism=zero2", f"parallelism.deepspeed_config={tmp_path / 'nope.json'}"])
    with pytest.raises(ConfigError, match="deepspeed engine shards with ZeRO over dp_replicate only"):
        validate(compose(["model=tiny", "parallelism=zero3", "parallelism.tp=2"]), world_size=4)

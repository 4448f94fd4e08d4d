"""train.batch_size_schedule: the ramp's batch per step, the run's length, the LR by samples, and what is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lmforge.config.batch_ramp import BatchRamp, batch_ramp, check_batch_ramp, run_samples, run_steps
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.optim import OptimConfig
from lmforge.config.train import BatchSizeScheduleConfig, TrainConfig
from lmforge.config.validate import validate
from lmforge.data.stream_size import stream_sizes
from lmforge.optim.schedule import lr_multiplier, lr_multiplier_at


def ramped(start=8, increment=8, ramp_samples=96, global_batch=32, max_steps=10, micro=4) -> TrainConfig:
    schedule = BatchSizeScheduleConfig(start=start, increment=increment, ramp_samples=ramp_samples)
    return TrainConfig(
        max_steps=max_steps, micro_batch_size=micro, global_batch_size=global_batch, batch_size_schedule=schedule
    )


def test_the_batch_grows_in_equal_stages_by_samples_consumed():
    ramp = BatchRamp(start=8, increment=8, ramp_samples=96, global_batch=32)  # 3 stages of 32 samples
    assert ramp.stages == 3
    walked, consumed = [], 0
    while consumed < 200:
        walked.append(ramp.batch_at(consumed))
        consumed += walked[-1]
    # stage = floor(consumed * 3 / 96): 0,8,16,24 -> 8; 32 -> 16; 48 -> 16; 64 -> 24; 88 -> 24; then 32 from 112
    assert walked == [8, 8, 8, 8, 16, 16, 24, 24, 32, 32, 32]
    assert ramp.ramp_steps == 8 and ramp.samples_before(8) == 112
    assert [ramp.samples_before(s) for s in range(11)] == [0, 8, 16, 24, 32, 48, 64, 88, 112, 144, 176]


def test_the_run_reaches_max_steps_full_batches_with_a_whole_last_step():
    train = ramped(max_steps=10)  # 320 samples
    ramp = batch_ramp(train)
    assert run_steps(train) == 15 and run_samples(train) == 336  # 112 + 7 x 32 = 336 >= 320: one step past
    assert ramp.steps_to_reach(320) == 15 and ramp.steps_to_reach(112) == 8 and ramp.steps_to_reach(20) == 3
    assert stream_sizes(train, 32 * 128, 32, 128) == (320, 336)  # the index holds the whole last step
    plain = replace(train, batch_size_schedule=BatchSizeScheduleConfig())
    assert batch_ramp(plain) is None and run_steps(plain) == 10 and run_samples(plain) == 320


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_by_samples_with_a_constant_batch_is_the_per_step_schedule_bit_for_bit(schedule):
    cfg = OptimConfig(schedule=schedule, warmup_steps=7, decay_steps=13 if schedule == "wsd" else 0)
    g = 24
    per_step = [lr_multiplier(s, cfg, 50) for s in range(50)]
    assert [lr_multiplier_at(s * g, (s + 1) * g, g, cfg, max_steps=50) for s in range(50)] == per_step
    assert len(set(per_step)) > 3  # control: the schedule moves


def test_under_a_ramp_the_lr_follows_samples_not_steps():
    """Warmup over 4 full batches = 128 samples: the ramp's small steps advance it by their share."""
    ramp = BatchRamp(start=8, increment=8, ramp_samples=96, global_batch=32)
    cfg = OptimConfig(schedule="cosine", warmup_steps=4)
    lrs = [
        lr_multiplier_at(ramp.samples_before(s), ramp.samples_before(s + 1), 32, cfg, max_steps=10) for s in range(6)
    ]
    assert lrs == [8 / 128, 16 / 128, 24 / 128, 32 / 128, 48 / 128, 64 / 128]
    assert lr_multiplier(0, cfg, 10) == 1 / 4  # control: by step, the first step would take a quarter of the peak


def refusal(train: TrainConfig, dp: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        check_batch_ramp(train, dp)
    return str(e.value)


def test_every_stage_must_be_a_multiple_of_micro_times_dp():
    check_batch_ramp(ramped(), 2)  # 8, 8 and 32 are multiples of micro 4 x dp 2: accepted
    assert refusal(ramped(), 4) == (
        "config key 'train.batch_size_schedule.start': 8 is not a multiple of micro_batch_size x data-parallel "
        "size = 16. Fix: use 16 or 32"
    )
    assert refusal(ramped(start=16, increment=8), 4) == (
        "config key 'train.batch_size_schedule.increment': 8 is not a positive multiple of micro_batch_size x "
        "data-parallel size = 16. Fix: use 16 or 32"
    )
    assert refusal(ramped(start=8, increment=16)) == (
        "config key 'train.batch_size_schedule.increment': 16 does not divide train.global_batch_size - start = "
        "24. Fix: use one of 4, 8, 12, 24"
    )
    assert refusal(ramped(start=32)) == (
        "config key 'train.batch_size_schedule.start': 32 is not below train.global_batch_size (32). Fix: set a "
        "start < 32, or 0 (off)"
    )
    assert refusal(ramped(ramp_samples=0)).startswith("config key 'train.batch_size_schedule.ramp_samples': is 0")
    assert refusal(ramped(start=0)).startswith("config key 'train.batch_size_schedule.start': is 0 (no ramp)")


def test_validate_refuses_a_ramp_the_data_parallel_size_does_not_divide():
    overrides = ["train.micro_batch_size=4", "train.global_batch_size=32", "train.batch_size_schedule.increment=8"]
    overrides += ["train.batch_size_schedule.start=8", "train.batch_size_schedule.ramp_samples=64"]
    validate(compose(overrides + ["parallelism=ddp"]), world_size=2)  # control: micro x dp = 8 divides them
    with pytest.raises(ConfigError, match="'train.batch_size_schedule.start': 8 is not a multiple of .* = 16"):
        validate(compose(overrides + ["parallelism=ddp", "parallelism.dp_replicate=4"]), world_size=4)

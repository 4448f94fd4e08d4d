"""The wsd schedule's decay (optim/schedule.py): its shapes, its length in steps or as a fraction, and the property
cooldown branches rest on: until its decay a step's rate does not depend on train.max_steps."""

from __future__ import annotations

import math

import pytest

from lmforge.config.optim import OptimConfig
from lmforge.optim.schedule import lr_multiplier


def wsd(**changes) -> OptimConfig:
    return OptimConfig(schedule="wsd", warmup_steps=2, min_lr_ratio=0.1, **changes)


@pytest.mark.parametrize(
    "shape, left",
    [
        ("linear", lambda p: 1 - p),
        ("1-sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_each_shape_decays_from_lr_to_the_floor_over_the_last_decay_steps(shape, left):
    cfg = wsd(decay_steps=4, decay_shape=shape)
    got = [lr_multiplier(s, cfg, 10) for s in range(10)]
    assert got[:6] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]  # warmup, then stable until step 6 = 10 - 4
    assert got[6:] == pytest.approx([0.1 + 0.9 * left(p) for p in (0.25, 0.5, 0.75, 1.0)])
    assert got[-1] == pytest.approx(0.1)


def test_without_decay_steps_the_fraction_of_max_steps_decays_linearly_as_before():
    cfg = wsd(decay_fraction=0.2)
    assert [lr_multiplier(s, cfg, 10) for s in range(7, 10)] == pytest.approx([1.0, 0.55, 0.1])


def test_a_stable_step_has_the_same_rate_whatever_the_runs_length_and_the_decay_follows_it():
    """A cooldown branch of a stable run planned for 1000 steps, resumed at step 300 with max_steps=400, takes the
    rates of a run planned for 400 steps from the start: the same stable phase, the same decay."""
    cfg = wsd(decay_steps=100, decay_shape="1-sqrt")
    stable = [lr_multiplier(s, cfg, 1000) for s in range(300)]
    planned = [lr_multiplier(s, cfg, 400) for s in range(400)]
    assert stable == planned[:300] and planned[300] < 1.0 and planned[-1] == pytest.approx(0.1)
    fraction = wsd(decay_fraction=0.25)  # the control: a decay set as a fraction moves with max_steps
    assert lr_multiplier(350, fraction, 1000) == 1.0 and lr_multiplier(350, fraction, 400) < 1.0

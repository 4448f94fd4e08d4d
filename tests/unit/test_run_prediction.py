"""Every run beside its own plan (parallel/planner.run_prediction, prediction_gap): the figures a training logs
are `lmforge plan`'s for the same config and device, and the GPU warning fires only beyond 25%."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.parallel.planner import gib, make_plan, prediction_gap, run_prediction


def test_the_logged_prediction_is_the_plan_of_the_same_config():
    cfg = validate(compose(["model=tiny", "train.device=cpu"]), world_size=1).cfg
    predicted = run_prediction(cfg, torch.device("cpu"), 1, peak=0.05)
    plan = make_plan(cfg, 1, peak=0.05)
    assert predicted == {
        "predicted_step_time_s": plan.step_time_s,
        "predicted_tokens_per_s": plan.tokens_per_s,
        "predicted_mfu": plan.expected_mfu,
        "predicted_peak_memory_gib": gib(plan.memory.total),
    }
    assert run_prediction(cfg, torch.device("cpu"), 1, peak=0.1)["predicted_step_time_s"] < plan.step_time_s


def test_a_gpu_the_tables_do_not_know_is_the_config_error_the_trainer_turns_into_a_note(monkeypatch):
    from lmforge.parallel import planner

    cfg = validate(compose(["model=tiny", "train.device=cpu"]), world_size=1).cfg
    monkeypatch.setattr(planner, "cuda_kind", lambda device: "tpu-v9")
    with pytest.raises(ConfigError, match="tpu-v9"):
        run_prediction(cfg, torch.device("cuda", 0), 1, peak=0.05)


def test_the_gap_warning_names_what_is_off_and_stays_quiet_within_25_percent():
    record = {"step": 20, "step_time_s": 0.52, "predicted_step_time_s": 0.38, "peak_memory_gib": 60.0}
    record["predicted_peak_memory_gib"] = 55.0  # 9% off: not named
    assert prediction_gap(record) == (
        "the planner's prediction is off by more than 25% at step 20: step time 0.52 measured vs 0.38 predicted "
        "(1.37x). `lmforge plan` with this run's overrides shows where it puts the time; cluster.gemm_tflops or a "
        "`lmforge comm bench` file gives it this machine's measured rates"
    )
    assert prediction_gap({**record, "step_time_s": 0.45}) is None  # 18% off
    assert prediction_gap({"step": 1, "step_time_s": 0.5}) is None  # no prediction logged: nothing to compare

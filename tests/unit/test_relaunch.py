"""A launch that resumes a checkpoint is checked against what produced it (``checkpoint.relaunch_check``), each
launch is recorded beside the run's config (``trainer.launch_record``), and the console says what happened
(checkpoint paths, save before commit). In one process, on real Hydra compositions, real checkpoint saves and
real files read back; the same launches through ``lmforge.train``: tests/e2e/test_relaunch_cli.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.checkpoint.extra_state import scheduler_state
from lmforge.checkpoint.manager import CheckpointManager, ResumePoint
from lmforge.checkpoint.relaunch_check import check_relaunch
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.record import config_changes, config_dict
from lmforge.config.validate import validate
from lmforge.metrics.logger import MetricsLogger
from lmforge.metrics.sinks import PlainConsoleSink
from lmforge.runtime.rundir import RunPaths
from lmforge.trainer.launch_record import write_launch_record

SMOKE = ["+exp=smoke"]  # 300 steps at optim.lr=3e-3 (conf/exp/smoke.yaml)
CKPT = Path("runs/smoke/checkpoints/step-00000300")
_COMPOSED: dict = {}


def composed(overrides):
    """``validate(compose(overrides))``'s typed config, as ``lmforge train`` composes it (composed once here)."""
    key = tuple(overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = validate(compose(list(overrides))).cfg
    return _COMPOSED[key]


def config(overrides) -> dict:
    """A launch's recorded config (``config_dict``) for ``overrides``."""
    return config_dict(composed(overrides))


def sidecar(overrides, step: int) -> dict:
    """The ``state.json`` fields a launch with ``overrides`` saves at ``step`` (``Trainer.sidecar``)."""
    cfg = composed(overrides)
    return {
        "step": step,
        "config": config_dict(cfg),
        "scheduler": scheduler_state(cfg.optim, cfg.train.max_steps, step, cfg.optim.lr),
    }


def refusal(overrides, side=None, path=CKPT) -> str:
    with pytest.raises(ConfigError) as err:
        check_relaunch(path, side or sidecar(SMOKE, 300), config(overrides))
    return str(err.value)


def test_a_finished_run_relaunched_with_another_lr_and_fewer_steps_is_refused_with_a_new_run_as_the_fix():
    assert refusal([*SMOKE, "optim.lr=1e-3", "train.max_steps=100"]) == (
        f"config key 'train.max_steps': the run is finished: checkpoint {CKPT} is at step 300, and "
        "train.max_steps=100 leaves nothing to train (this launch changes optim.lr 0.003 -> 0.001, train.max_steps "
        f"300 -> 100). Fix: start a new run with run.name=smoke-2 (add train.init_from={CKPT} to start from its "
        "weights)"
    )


def test_a_finished_run_relaunched_with_eval_tasks_names_the_offline_scorer():
    assert refusal([*SMOKE, "eval.tasks=[austen_next_sentence,stdlib_next_line]", "eval.limit=50"]) == (
        f"config key 'train.max_steps': the run is finished: checkpoint {CKPT} is at step 300, and "
        'train.max_steps=300 leaves nothing to train (this launch changes eval.tasks [] -> ["austen_next_sentence", '
        '"stdlib_next_line"], eval.limit 0 -> 50). Fix: score the checkpoint without training: python -m '
        f"lmforge.evaluation.offline {CKPT} --tasks austen_next_sentence,stdlib_next_line --limit 50"
    )


def test_a_finished_run_relaunched_unchanged_lists_every_way_on():
    assert refusal(SMOKE) == (
        f"config key 'train.max_steps': the run is finished: checkpoint {CKPT} is at step 300, and "
        "train.max_steps=300 leaves nothing to train. Fix: train it further with train.max_steps above 300, start a "
        f"new run with run.name=smoke-2 (add train.init_from={CKPT} to start from its weights), or score it: "
        f"python -m lmforge.evaluation.offline {CKPT}"
    )


def test_training_a_finished_run_further_under_another_lr_is_refused():
    assert refusal([*SMOKE, "optim.lr=1e-3", "train.max_steps=600"]) == (
        f"config key 'optim.lr': the run is finished: checkpoint {CKPT} is at step 300 (its train.max_steps=300), "
        "and this launch would train it further to train.max_steps=600 under another optimizer or LR schedule "
        "(this launch changes optim.lr 0.003 -> 0.001). Fix: train it further with its own settings "
        f"(optim.lr=0.003), or start a new run with run.name=smoke-2 (add train.init_from={CKPT} to start from its "
        "weights)"
    )


def test_a_stop_at_step_already_reached_is_refused():
    side = sidecar([*SMOKE, "train.stop_at_step=20"], 20)
    assert refusal([*SMOKE, "train.stop_at_step=20"], side, CKPT.with_name("step-00000020")) == (
        f"config key 'train.stop_at_step': checkpoint {CKPT.with_name('step-00000020')} is at step 20, and "
        "train.stop_at_step=20 leaves nothing to train. Fix: raise train.stop_at_step above 20, or leave it out to "
        "train to train.max_steps=300"
    )


def test_continuations_pass():
    """Training a finished run further with its own settings, and any resume of an unfinished run (a changed LR
    is warned about by the Trainer), train: no refusal."""
    finished = sidecar(SMOKE, 300)
    assert check_relaunch(CKPT, finished, config([*SMOKE, "train.max_steps=600"])) is None
    assert check_relaunch(CKPT, finished, config([*SMOKE, "train.max_steps=600", "optim.lr=3e-3"])) is None
    stopped = sidecar([*SMOKE, "train.stop_at_step=20"], 20)
    assert check_relaunch(CKPT, stopped, config(SMOKE)) is None
    assert check_relaunch(CKPT, stopped, config([*SMOKE, "optim.lr=1e-3"])) is None
    # A sidecar without a config (an imported or older checkpoint) is checked on its step alone.
    assert check_relaunch(CKPT, {"step": 20}, config(SMOKE)) is None
    with pytest.raises(ConfigError, match="^config key 'train.max_steps': checkpoint .* is at step 300, and "):
        check_relaunch(CKPT, {"step": 300}, config(SMOKE))


def test_a_restart_of_the_same_job_after_its_final_save_finishes_and_a_changed_one_is_still_refused():
    """A torchrun restart or a Slurm requeue that finds the final checkpoint with its own config finishes (nothing
    to train, exit 0); the same restart with a changed key is refused as any launch is (negative control)."""
    finished = sidecar(SMOKE, 300)
    assert check_relaunch(CKPT, finished, config(SMOKE), restarted=True) is None
    with pytest.raises(ConfigError, match="^config key 'train.max_steps': the run is finished"):
        check_relaunch(CKPT, finished, config([*SMOKE, "optim.lr=1e-3", "train.max_steps=100"]), restarted=True)
    with pytest.raises(ConfigError, match="^config key 'train.max_steps': the run is finished"):
        check_relaunch(CKPT, finished, config(SMOKE), restarted=False)


def test_config_changes_name_dotted_keys_and_leave_out_train_resume():
    old = {"optim": {"lr": 0.003, "betas": [0.9, 0.95]}, "train": {"resume": "auto", "max_steps": 300}}
    new = {"optim": {"lr": 0.003, "betas": [0.9, 0.99]}, "train": {"resume": "/x", "max_steps": 300}, "eval": {}}
    assert config_changes(old, new) == {"optim.betas": ([0.9, 0.95], [0.9, 0.99]), "eval": (None, {})}
    assert config_changes(old, old) == {}


def test_each_launch_is_recorded_beside_a_config_yaml_it_never_rewrites(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    first = config(SMOKE)
    assert write_launch_record(paths, first, 0, None) == paths.launches / "launch-000.yaml"
    point = ResumePoint(paths.checkpoints / "step-00000300", sidecar(SMOKE, 300))
    longer = config([*SMOKE, "train.max_steps=600"])
    assert write_launch_record(paths, longer, 300, point) == paths.launches / "launch-001.yaml"
    zero, one = (yaml.safe_load((paths.launches / f"launch-00{i}.yaml").read_text()) for i in (0, 1))
    assert (zero["launch"], zero["start_step"], zero["resumed_from"], zero["changed"]) == (0, 0, None, {})
    assert zero["config"] == first and one["config"] == longer
    assert (one["launch"], one["start_step"], one["resumed_from"]) == (1, 300, str(point.path))
    assert one["changed"] == {"train.max_steps": {"checkpoint": 300, "launch": 600}}
    assert not paths.config.exists()  # the launch record is written beside config.yaml, never into it


def test_console_events_name_the_checkpoint_path_without_a_trailing_space():
    out = io.StringIO()
    log = MetricsLogger([PlainConsoleSink(out)])
    log.event("checkpoint_commit", step=300, write_s=0.5, path="/r/checkpoints/step-00000300")
    log.event("resume", step=20, cause="resumed from step 20", path="/r/checkpoints/step-00000020")
    log.event("comm_preflight_skipped", step=0)
    assert out.getvalue().splitlines() == [
        "[event] checkpoint_commit step=300 rank=0 path=/r/checkpoints/step-00000300",
        "[event] resume step=20 rank=0 resumed from step 20 path=/r/checkpoints/step-00000020",
        "[event] comm_preflight_skipped step=0 rank=0",
    ]


@pytest.mark.parametrize("mode", ["none", "thread"])
def test_a_save_is_reported_before_its_commit(tmp_path, mode):
    order = []
    mgr = CheckpointManager(tmp_path, CheckpointConfig(async_mode=mode))
    mgr.on_save = lambda step, path, stall_s: order.append(("save", step, path.name))
    mgr.on_commit = lambda step, path, write_s: order.append(("commit", step, path.name))
    mgr.save(3, torch.nn.Linear(4, 4), None, {"world_size": 1})
    mgr.wait()
    assert order == [("save", 3, "step-00000003"), ("commit", 3, "step-00000003")]


RAMPED = [
    "train.max_steps=4",
    "train.micro_batch_size=1",
    "train.global_batch_size=8",
    "train.batch_size_schedule.start=2",
    "train.batch_size_schedule.increment=2",
    "train.batch_size_schedule.ramp_samples=24",
]  # 2, 2, 2, 2, 4, 4, 6, 6, 8: nine optimizer steps reach train.max_steps x 8 = 32 samples


def test_under_a_batch_ramp_a_run_ends_at_its_optimizer_steps_not_at_max_steps():
    check_relaunch(CKPT, sidecar(RAMPED, 5), config(RAMPED))  # step 5 of 9: mid-ramp, it trains on
    check_relaunch(CKPT, sidecar(RAMPED, 8), config(RAMPED + ["train.stop_at_step=9"]))
    assert refusal(RAMPED, sidecar(RAMPED, 9)).startswith(
        f"config key 'train.max_steps': the run is finished: checkpoint {CKPT} is at step 9, and train.max_steps=4 "
        "(9 optimizer steps under train.batch_size_schedule) leaves nothing to train"
    )

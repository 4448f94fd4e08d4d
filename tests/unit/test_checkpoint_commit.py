"""The commit protocol in one process: the order of fsyncs and renames, a re-save interrupted at every stage
leaves a loadable checkpoint, and the file/directory modes (checkpoints 0o640/0o750, run directories 0o750).

The SIGKILL version with training resumed bit-identically is tests/distributed/test_commit_kill.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmforge.checkpoint import commit as commit_mod
from lmforge.checkpoint import fault_injection
from lmforge.checkpoint.commit import STAGES
from lmforge.checkpoint.layout import aside_dir, complete_checkpoints, latest, step_dir, tmp_dir
from lmforge.checkpoint.manager import CheckpointManager, ResumePoint, resolve_resume, resume_target
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.runtime.rundir import RunPaths
from lmforge.trainer.startup import continued_line


class Crash(BaseException):
    pass


def _save(root: Path, step: int, value: float, stage_to_crash=None) -> None:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(value)

    def hook(stage, s, final):
        if stage == stage_to_crash:
            raise Crash(stage)

    fault_injection.install_commit_hook(hook if stage_to_crash else None)
    try:
        CheckpointManager(root, CheckpointConfig(keep_last=5)).save(step, model, None, {"world_size": 1})
    finally:
        fault_injection.install_commit_hook(None)


def _weight(path: Path) -> float:
    model = torch.nn.Linear(2, 2)
    CheckpointManager(path.parent, CheckpointConfig()).load(path, model, None, restore_rng=False)
    return float(model.weight[0, 0])


def test_fsync_and_rename_order_of_a_resave(tmp_path, monkeypatch):
    """Tensor files, state.json, COMPLETE, the directory, old copy aside, rename in, parent, aside removed."""
    _save(tmp_path, 2, 1.0)
    events = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, commit_mod.shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), tmp_path)))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", os.path.relpath(a, tmp_path), os.path.relpath(b, tmp_path)))
        return real_replace(a, b)

    def rmtree(path, *a, **k):
        events.append(("rmtree", os.path.relpath(path, tmp_path)))
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(commit_mod.os, "fsync", fsync)
    monkeypatch.setattr(commit_mod.os, "replace", replace)
    monkeypatch.setattr(commit_mod.shutil, "rmtree", rmtree)
    fault_injection.install_commit_hook(lambda stage, step, final: events.append(("stage", stage)))
    try:
        CheckpointManager(tmp_path, CheckpointConfig(keep_last=5)).save(
            2, torch.nn.Linear(2, 2), None, {"world_size": 1}
        )
    finally:
        fault_injection.install_commit_hook(None)
    tmp = ".tmp-step-00000002"
    before = events[: events.index(("stage", "shards"))]
    assert {e[0] for e in before} == {"fsync"}  # DCP's own fsyncs, then ours of every file in the directory
    assert [e[1] for e in before[-2:]] in (
        [f"{tmp}/.metadata", f"{tmp}/__0_0.distcp"],
        [f"{tmp}/__0_0.distcp", f"{tmp}/.metadata"],
    )
    rest = events[events.index(("stage", "shards")) :]
    assert rest == [
        ("stage", "shards"),
        ("fsync", f"{tmp}/state.json.part"),
        ("rename", f"{tmp}/state.json.part", f"{tmp}/state.json"),
        ("stage", "sidecar"),
        ("fsync", f"{tmp}/COMPLETE.part"),
        ("rename", f"{tmp}/COMPLETE.part", f"{tmp}/COMPLETE"),
        ("fsync", tmp),
        ("stage", "complete"),
        ("rename", "step-00000002", ".old-step-00000002"),
        ("fsync", "."),
        ("stage", "aside"),
        ("rename", tmp, "step-00000002"),
        ("fsync", "."),
        ("stage", "renamed"),
        ("rmtree", ".old-step-00000002"),
        ("fsync", "."),
    ]


@pytest.mark.parametrize("stage", STAGES)
def test_resave_interrupted_at_each_stage_keeps_a_loadable_copy(tmp_path, stage):
    _save(tmp_path, 2, 1.0)
    with pytest.raises(Crash):
        _save(tmp_path, 2, 2.0, stage_to_crash=stage)
    found = resolve_resume(tmp_path, "auto")
    # Before the rename-in the old copy (under its name, or aside) is the checkpoint; from then on the new one.
    expect = {
        "shards": ("step-00000002", 1.0),
        "sidecar": ("step-00000002", 1.0),
        "complete": ("step-00000002", 1.0),
        "aside": (".old-step-00000002", 1.0),
        "renamed": ("step-00000002", 2.0),
    }[stage]
    assert (found.name, _weight(found)) == expect
    # An explicit train.resume=<run>/checkpoints/step-00000002 finds the aside copy too.
    assert resolve_resume(tmp_path, str(step_dir(tmp_path, 2))) == found
    _save(tmp_path, 3, 3.0)  # the next commit finishes the interrupted re-save's cleanup
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    assert _weight(step_dir(tmp_path, 2)) == expect[1]


@pytest.mark.parametrize("stage", ["shards", "sidecar", "complete"])
def test_first_save_interrupted_before_its_rename_leaves_the_previous_step(tmp_path, stage):
    _save(tmp_path, 2, 1.0)
    with pytest.raises(Crash):
        _save(tmp_path, 4, 2.0, stage_to_crash=stage)
    assert resolve_resume(tmp_path, "auto") == step_dir(tmp_path, 2) and tmp_dir(tmp_path, 4).is_dir()


def test_negative_control_deleting_before_rename_loses_the_step(tmp_path):
    """The old protocol (delete step-N, then rename the new copy in) crashed in between: no step-N anywhere."""
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 1.0)
    with pytest.raises(Crash):
        _save(tmp_path, 2, 2.0, stage_to_crash="aside")
    os.replace(aside_dir(tmp_path, 2), tmp_path / "deleted")  # what rmtree(step-N) would have left
    assert latest(tmp_path) == step_dir(tmp_path, 1)
    assert tmp_dir(tmp_path, 2).is_dir() and [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000001"]


def test_checkpoint_and_run_directory_modes(tmp_path):
    old = os.umask(0)  # the modes are the platform's, not the umask's
    try:
        _save(tmp_path / "checkpoints", 1, 1.0)
        run = RunPaths(tmp_path / "run").make()
    finally:
        os.umask(old)
    ckpt = step_dir(tmp_path / "checkpoints", 1)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in ckpt.iterdir()} == {
        ".metadata": "0o640",
        "__0_0.distcp": "0o640",
        "state.json": "0o640",
        "COMPLETE": "0o640",
    }
    assert oct(ckpt.stat().st_mode & 0o777) == oct((tmp_path / "checkpoints").stat().st_mode & 0o777) == "0o750"
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (run.root, run.checkpoints, run.logs)} == {
        "run": "0o750",
        "checkpoints": "0o750",
        "logs": "0o750",
    }


def test_resume_resolution_errors_come_from_one_function(tmp_path):
    from lmforge.checkpoint.manager import CheckpointError

    _save(tmp_path, 2, 1.0)
    assert resolve_resume(tmp_path, "none") is None and resolve_resume(tmp_path, str(tmp_path)) == step_dir(tmp_path, 2)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(tmp_path, str(tmp_path / "step-00000009"))
    assert str(err.value) == (
        f"train.resume={tmp_path}/step-00000009: no such directory. Fix: point at a "
        f"step-NNNNNNNN directory or its parent, or use train.resume=auto"
    )
    (tmp_path / "step-00000007").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(tmp_path / "step-00000007"))


def test_a_checkpoint_named_outside_the_run_is_where_it_starts_not_a_pin(tmp_path):
    """train.resume=<another run's checkpoint>: the run starts there; once it has a checkpoint of its own, a
    relaunch with the same command continues from that (a branch preempted mid-decay does not start over). A
    checkpoint named inside the run (a roll-back) is resumed exactly."""
    stable, branch = tmp_path / "stable" / "checkpoints", tmp_path / "branch" / "checkpoints"
    _save(stable, 3, 1.0)
    named = str(step_dir(stable, 3))
    assert resume_target(branch, named) == (step_dir(stable, 3), None)  # a fresh branch starts at the stable run
    _save(branch, 4, 2.0)
    _save(branch, 5, 3.0)
    assert resume_target(branch, named) == (step_dir(branch, 5), step_dir(stable, 3))  # its own newest wins
    assert resume_target(branch, str(stable)) == (step_dir(branch, 5), step_dir(stable, 3))
    assert resume_target(branch, str(step_dir(branch, 4))) == (step_dir(branch, 4), None)  # roll-back: as named
    assert resume_target(branch, "auto") == (step_dir(branch, 5), None)
    assert resume_target(branch, "none") == (None, None)
    # the line a relaunch prints (rank 0), naming both checkpoints
    line = continued_line(ResumePoint(step_dir(branch, 5), {}, step_dir(stable, 3)))
    assert line.startswith(f"lmforge: train.resume={step_dir(stable, 3)} is where this run started;")
    assert f"continues from its own newest checkpoint {step_dir(branch, 5)}" in line

"""The run contract: one run directory per run, the same on every rank and across restarts."""

from __future__ import annotations

from pathlib import Path

from lmforge.runtime.rundir import made_by_launch, remove_refused, resolve_run_dir, run_id_from_env


def test_precedence(tmp_path):
    env = {"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}
    assert resolve_run_dir(tmp_path, "named", "point", env) == tmp_path / "named"
    assert resolve_run_dir(tmp_path, None, "point", env) == tmp_path / "point"
    assert resolve_run_dir(tmp_path, None, None, env) == tmp_path / "slurm-77"
    assert resolve_run_dir(tmp_path, None, None, {"TORCHELASTIC_RUN_ID": "abc"}) == tmp_path / "torchrun-abc"
    assert run_id_from_env({"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "4", "SLURM_ARRAY_TASK_ID": "2"}) == "slurm-4_2"
    assert run_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None


def refused_start(run: Path) -> None:
    """What a start refused before training writes: Hydra's record and job log, the verdict, an empty folder."""
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run / ".hydra" / name).write_text("x: 1\n")
    (run / "train.log").write_text("")
    (run / "verdicts").mkdir(exist_ok=True)
    (run / "verdicts" / "rank0.json").write_text("{}")
    (run / "logs").mkdir(exist_ok=True)


def test_a_refused_start_removes_the_directories_its_launch_made(tmp_path):
    run = tmp_path / "runs" / "my-run"
    made = made_by_launch(run)
    assert made == tmp_path / "runs"  # run.root did not exist either: it goes too
    refused_start(run)
    assert remove_refused(run, made)
    assert list(tmp_path.iterdir()) == []


def test_a_refused_start_keeps_a_run_directory_that_was_there_and_anything_it_did_not_write(tmp_path):
    old = tmp_path / "runs" / "old"
    (old / "checkpoints" / "step-00000010").mkdir(parents=True)
    (old / "checkpoints" / "step-00000010" / "COMPLETE").write_text("10")
    assert made_by_launch(old) is None  # negative control: an earlier run's directory
    refused_start(old)
    assert not remove_refused(old, made_by_launch(old))
    assert (old / "checkpoints" / "step-00000010" / "COMPLETE").read_text() == "10"
    new = tmp_path / "runs" / "new"
    made = made_by_launch(new)
    assert made == new  # run.root is there: only the run directory is this launch's
    refused_start(new)
    (new / "metrics.jsonl").write_text("{}\n")  # not what a refused start writes (another launch of the same name)
    assert not remove_refused(new, made) and (new / "metrics.jsonl").exists()
    (new / "metrics.jsonl").unlink()
    assert remove_refused(new, made) and not new.exists() and old.is_dir()


def test_a_fresh_run_id_made_by_this_process_counts_as_its_launch(tmp_path, monkeypatch):
    from lmforge.runtime import rundir

    monkeypatch.setattr(rundir, "_FRESH_ID", None)
    monkeypatch.setattr(rundir, "_FRESH_MADE", None)
    monkeypatch.delenv("LMFORGE_RUN_ID", raising=False)
    run = resolve_run_dir(tmp_path / "runs", env={})
    assert run.is_dir()  # made exclusively while the name was resolved
    assert made_by_launch(run) == tmp_path / "runs"
    assert made_by_launch(tmp_path / "runs" / "other") == tmp_path / "runs" / "other"
    refused_start(run)
    assert remove_refused(run, made_by_launch(run)) and not (tmp_path / "runs").exists()

"""The run contract: one run directory per run, the same on every rank and across restarts."""

from __future__ import annotations

from lmforge.runtime.rundir import resolve_run_dir, run_id_from_env


def test_precedence(tmp_path):
    env = {"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}
    assert resolve_run_dir(tmp_path, "named", "point", env) == tmp_path / "named"
    assert resolve_run_dir(tmp_path, None, "point", env) == tmp_path / "point"
    assert resolve_run_dir(tmp_path, None, None, env) == tmp_path / "slurm-77"
    assert resolve_run_dir(tmp_path, None, None, {"TORCHELASTIC_RUN_ID": "abc"}) == tmp_path / "torchrun-abc"
    assert run_id_from_env({"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "4", "SLURM_ARRAY_TASK_ID": "2"}) == "slurm-4_2"
    assert run_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None

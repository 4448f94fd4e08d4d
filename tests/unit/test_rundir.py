"""The run contract: one run directory per run, the same on every rank and across restarts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lmforge.runtime.rundir import made_by_launch, remove_refused, resolve_run_dir, run_id_from_env

PROBE = (
    "import json,sys; from lmforge.runtime.rundir import resolve_run_dir as r; "
    "print(json.dumps([str(r(sys.argv[1])), str(r(sys.argv[1]))]))"
)


def probe(root: Path, env: dict) -> list[str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "LMFORGE_RUN_ID"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(root)],
        env={**keep, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_precedence(tmp_path):
    env = {"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "abc"}
    assert resolve_run_dir(tmp_path, "named", "point", env) == tmp_path / "named"
    assert resolve_run_dir(tmp_path, None, "point", env) == tmp_path / "point"
    assert resolve_run_dir(tmp_path, None, None, env) == tmp_path / "slurm-77"
    assert resolve_run_dir(tmp_path, None, None, {"TORCHELASTIC_RUN_ID": "abc"}) == tmp_path / "torchrun-abc"
    assert run_id_from_env({"SLURM_JOB_ID": "5", "SLURM_ARRAY_JOB_ID": "4", "SLURM_ARRAY_TASK_ID": "2"}) == "slurm-4_2"
    assert run_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None


def test_same_answer_on_every_rank_and_restart(tmp_path):
    """Simulated ranks (separate processes) and a restart (a later process with a new restart count)."""
    answers = set()
    for rank in range(3):
        for restart in range(2):
            env = {
                "SLURM_JOB_ID": "4242",
                "RANK": str(rank),
                "SLURM_RESTART_COUNT": str(restart),
                "TORCHELASTIC_RESTART_COUNT": str(restart),
            }
            answers.update(probe(tmp_path, env))
    assert answers == {str(tmp_path / "slurm-4242")}
    torchrun = {tuple(probe(tmp_path, {"TORCHELASTIC_RUN_ID": "j1", "RANK": str(r)})) for r in range(2)}
    assert torchrun == {(str(tmp_path / "torchrun-j1"),) * 2}


def test_fresh_ids_never_collide_and_are_stable_within_a_process(tmp_path):
    dirs = []
    for _ in range(5):  # started within the same second
        first, second = probe(tmp_path, {})
        assert first == second
        dirs.append(first)
    assert len(set(dirs)) == 5
    assert all(Path(d).is_dir() for d in dirs)


def test_fresh_id_is_inherited_by_children(tmp_path):
    code = (
        "import os,subprocess,sys; from lmforge.runtime.rundir import resolve_run_dir as r; a=str(r(sys.argv[1])); "
        "b=subprocess.run([sys.executable,'-c','import sys; from lmforge.runtime.rundir import resolve_run_dir as r; "
        "print(r(sys.argv[1]))',sys.argv[1]],capture_output=True,text=True).stdout.strip(); print(a==b)"
    )
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "LMFORGE_RUN_ID"))}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=keep, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "True", out.stderr


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

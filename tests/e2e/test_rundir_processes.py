"""The run directory is the same on every rank and restart and a fresh id is never shared: answers read from real child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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

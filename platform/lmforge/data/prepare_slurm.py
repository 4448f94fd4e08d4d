"""``lmforge data prepare ... --launcher slurm-array``: an array job building the shards, then a finalize job.

The submitter has already written OUT/plan.json, so every task agrees on the shards. It submits
``slurm/prepare_array.sh OUT ...`` twice: as an array of T tasks (task t builds shards i with i % T == t),
and as one job that runs after the whole array succeeded (``--dependency=afterok``) and checks every shard
before writing OUT/manifest.json. A task that fails leaves the prefix incomplete: re-submitting resumes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import List, Sequence

from lmforge.runtime.env_vars import read


def array_script() -> Path:
    repo = read("LMFORGE_REPO")
    root = Path(repo) if repo else Path(__file__).resolve().parents[3]
    script = root / "slurm" / "prepare_array.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} does not exist. Fix: set LMFORGE_REPO to the lmforge checkout")
    return script


def _sbatch(args: List[str]) -> str:
    if shutil.which("sbatch") is None:
        raise FileNotFoundError(
            "sbatch is not on PATH: --launcher slurm-array runs on a Slurm login node. Fix: run "
            "it there, or prepare locally with --workers N"
        )
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ValueError(f"sbatch refused the job ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def submit_array(
    out: Path, tokenizer: str, cache_dir: str, workers: int, tasks: int, sbatch_args: Sequence[str] = ()
) -> str:
    """Submit the array and its finalize job; returns a line naming both job ids and where the logs go."""
    if tasks < 1:
        raise ValueError(f"--array-tasks must be >= 1, got {tasks}")
    out = out.absolute()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    script = str(array_script())
    common = ["--tokenizer", tokenizer, "--cache-dir", str(Path(cache_dir).absolute()), "--workers", str(workers)]
    array = _sbatch(
        [
            f"--array=0-{tasks - 1}",
            "--job-name=lmforge-prepare",
            f"--cpus-per-task={max(1, workers)}",
            "-o",
            f"{logs}/prepare-%A_%a.out",
            "-e",
            f"{logs}/prepare-%A_%a.err",
            *sbatch_args,
            script,
            str(out),
            *common,
        ]
    )
    final = _sbatch(
        [
            f"--dependency=afterok:{array}",
            "--kill-on-invalid-dep=yes",
            "--job-name=lmforge-prepare-finalize",
            "-o",
            f"{logs}/finalize-%j.out",
            "-e",
            f"{logs}/finalize-%j.err",
            *sbatch_args,
            script,
            str(out),
            "--finalize",
        ]
    )
    return (
        f"lmforge data prepare: array job {array} ({tasks} tasks) builds the shards of {out}; job {final} "
        f"checks them and writes {out}/manifest.json; logs in {logs}"
    )

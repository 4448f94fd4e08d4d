"""Deterministic failures under slurm/train.sh on the real Slurm cluster: one attempt, no torchrun restart,
no requeue, the verdict's message in the job log and its exit code as the job's.

Two 2-node jobs side by side (they need all 4 nodes for about a minute): a layout error that only the
workers can see (the layout needs 4 ranks, the job has 2) and a run that diverges under torchrun.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import REPO, TRAIN_OVERRIDES, events

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ENDED = ("COMPLETED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def submit(cluster, tmp: Path, name: str, overrides, env):
    root = tmp / name
    root.mkdir(parents=True, exist_ok=True)
    args = [
        "--nodes=2",
        f"--job-name={name}",
        "-o",
        f"{root}/job-%j.out",
        "-e",
        f"{root}/job-%j.err",
        str(REPO / "slurm" / "train.sh"),
        *TRAIN_OVERRIDES,
        f"run.root={root}/runs",
        "fault.max_restarts=3",
        "cluster.max_requeues=3",
        *overrides,
    ]
    job = cluster.sbatch(args, cwd=root, env=env)
    return job, root, root / "runs" / f"slurm-{job}"


def job_log(root: Path, job: str) -> str:
    return "\n".join(
        (root / f"job-{job}.{ext}").read_text(errors="replace")
        for ext in ("out", "err")
        if (root / f"job-{job}.{ext}").exists()
    )


@pytest.fixture(scope="module")
def failing_jobs(slurm_cluster, job_env, tmp_path_factory):
    slurm_cluster.wait_idle(4, timeout=300)  # after the other module's jobs
    tmp = tmp_path_factory.mktemp("verdict-jobs")
    # dp_replicate=4 on a 2-rank job: the batch script's prepare step (jobctl prepare, the job's real world size)
    # refuses it before srun starts a worker; a worker-side deterministic failure is the divergence job below.
    return {
        "layout": submit(
            slurm_cluster, tmp, "layout", ["parallelism.dp_replicate=4", "train.micro_batch_size=2"], job_env
        ),
        "diverge": submit(
            slurm_cluster,
            tmp,
            "diverge",
            ["optim.lr=1e30", "optim.warmup_steps=0", "fault.max_consecutive_skips=2"],
            job_env,
        ),
    }


def wait_failed(cluster, job: str, root: Path, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    info: dict = {}
    while time.monotonic() < deadline:
        info = cluster.job_info(job)
        if info.get("JobState") == "FAILED":
            return info
        assert info.get("JobState") not in ENDED, f"{info}\n{job_log(root, job)[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not fail within {timeout}s: {info}\n{job_log(root, job)[-4000:]}")


@pytest.mark.timeout(600)
def test_layout_error_ends_the_job_after_one_attempt_with_its_message(slurm_cluster, failing_jobs):
    job, root, run_dir = failing_jobs["layout"]
    info = wait_failed(slurm_cluster, job, root)
    text = job_log(root, job)
    assert int(info["Restarts"]) == 0 and info["ExitCode"] == "2:0", info
    assert "config key 'parallelism" in text and "world size 2" in text, text[-4000:]
    assert "lmforge: prepare refused the job (exit 2); no worker was started" in text, text[-4000:]
    assert "MASTER_ADDR=" not in text and text.count("lmforge: job ") == 1, text[-4000:]  # one attempt, no srun
    # Nothing to retry and nothing retried: no run state was written, no requeue.
    assert not (run_dir / "requeues.json").exists() and not (run_dir / "verdicts").exists()


@pytest.mark.timeout(600)
def test_divergence_under_torchrun_runs_once_and_the_job_exits_45(slurm_cluster, failing_jobs):
    job, root, run_dir = failing_jobs["diverge"]
    info = wait_failed(slurm_cluster, job, root)
    text = job_log(root, job)
    assert int(info["Restarts"]) == 0 and info["ExitCode"] == "45:0", info
    assert "not restarting the worker group (3 restarts left): diverged on rank" in text, text[-4000:]
    assert "lmforge: stop: diverged on rank" in text and "training diverged: 2 skipped steps in a row" in text
    state = json.loads((run_dir / "requeues.json").read_text())
    assert [(h["action"], h["kind"], h["exit_code"]) for h in state["history"]] == [("stop", "diverged", 45)]
    ev = [e["event"] for e in events(run_dir)]
    assert "diverged" in ev and "restart" not in ev and "requeue" not in ev, ev

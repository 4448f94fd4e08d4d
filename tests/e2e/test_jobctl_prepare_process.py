"""slurm/train.sh's prepare step (jobctl prepare) in processes of its own: a checkpoint of another shape refused before srun; exit 2 with one line, the export lines otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config.errors import ConfigError
from lmforge.launch.jobctl import check_job
from lmforge.runtime.device_contract import DeviceContractError

REPO = Path(__file__).resolve().parents[2]


BASE = [
    "model=tiny",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.threads=1",
    "train.device=cpu",
    "cluster.gpus_per_node=1",
]


JOB = {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "node1", "SLURM_NNODES": "2", "SLURM_CPUS_ON_NODE": "4"}


def refused(overrides, env=JOB) -> str:
    with pytest.raises((ConfigError, DeviceContractError)) as e:
        check_job(overrides, env)
    return str(e.value)


@pytest.mark.timeout(300)
def test_a_checkpoint_of_another_model_shape_is_refused_before_srun(tmp_path):
    """A (requeued) job resuming a checkpoint this model cannot load is refused at the prepare step, before srun
    starts a worker on every node; the same checkpoint with the same model passes."""
    run = [*BASE, "parallelism=ddp", f"run.root={tmp_path}", "run.name=r", "train.resume=auto"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.train",
            *BASE,
            f"run.root={tmp_path}",
            "run.name=r",
            "train.max_steps=1",
            "train.eval_every=0",
            "checkpoint.every_steps=1",
            "logging.console=plain",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert (tmp_path / "r" / "checkpoints" / "step-00000001" / "COMPLETE").is_file(), trained.stderr[-3000:]
    assert check_job(run, JOB)[0].model.d_model == 64
    message = refused([*run, "model.d_model=128"])
    assert (
        message.startswith("config key 'train.resume': checkpoint ")
        and "is of another model shape: it was saved with model.d_model=64 (this run: 128)" in message
    ), message


def test_prepare_exits_2_with_one_line_and_exports_otherwise(tmp_path):
    env = {**os.environ, **JOB, "PYTHONPATH": str(REPO / "platform")}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "lmforge.launch.jobctl", "prepare", "--"]
    bad = subprocess.run(
        [*cmd, *BASE, "cluster.nodes=3", f"run.root={tmp_path}"], env=env, capture_output=True, text=True, timeout=240
    )
    assert bad.returncode == 2 and bad.stdout == "", bad.stderr
    assert bad.stderr.splitlines() == [
        "lmforge: config key 'cluster.nodes': is 3 on the command line but the job has 2 nodes (SLURM_NNODES). Fix: "
        "drop cluster.nodes=3 (the allocation's node count is used) or submit with sbatch --nodes=3"
    ]
    assert not any(tmp_path.iterdir())  # refused before the run directory is made
    ok = subprocess.run(
        [*cmd, *BASE, "parallelism=ddp", f"run.root={tmp_path}"], env=env, capture_output=True, text=True, timeout=240
    )
    assert ok.returncode == 0, ok.stderr
    assert "export LMFORGE_JOB_OVERRIDES=cluster.nodes=2" in ok.stdout.splitlines()
    assert "export LMFORGE_NPROC_PER_NODE=1" in ok.stdout.splitlines()

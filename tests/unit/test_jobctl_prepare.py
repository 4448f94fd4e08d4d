"""slurm/train.sh's prepare step (``jobctl prepare``): the checks a job passes, with its real allocation's
environment, before srun starts a worker. Real Hydra composition; the Slurm variables are the ones Slurm sets.
(The same step inside a real Slurm job: tests/slurm/test_slurm_train.py, job G.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.config.errors import ConfigError
from lmforge.launch.allocation import resources
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


def test_the_allocation_sets_the_node_count(tmp_path):
    follow = [*BASE, "parallelism.dp_replicate=${cluster.nodes}", f"run.root={tmp_path}"]
    cfg, extra = check_job(follow, JOB)
    assert extra == "cluster.nodes=2" and cfg.cluster.nodes == 2 and cfg.parallelism.dp_replicate == 2
    cfg, extra = check_job([*follow, "cluster.nodes=2"], JOB)  # given and equal: nothing to add
    assert extra is None and cfg.parallelism.dp_replicate == 2
    assert refused([*follow, "cluster.nodes=3"]) == (
        "config key 'cluster.nodes': is 3 on the command line but the job has 2 nodes (SLURM_NNODES). Fix: drop "
        "cluster.nodes=3 (the allocation's node count is used) or submit with sbatch --nodes=3"
    )
    # Negative control: without the job's node count the same config plans 1 node and its layout is for 1 rank.
    cfg, extra = check_job(follow, {k: v for k, v in JOB.items() if k != "SLURM_NNODES"})
    assert extra is None and cfg.parallelism.dp_replicate == 1


def test_layout_memory_and_allocation_are_checked_for_the_real_world_size(tmp_path):
    root = f"run.root={tmp_path}"
    assert refused([*BASE, "parallelism=ddp", root], {**JOB, "SLURM_NNODES": "4"}) == (
        "config key 'parallelism': dp_replicate*dp_shard*tp*pp = 2*1*1*1 = 2 but the job has world size 4. "
        "Fix: make the product equal 4 (e.g. parallelism.dp_shard=2)"
    )
    assert refused(
        [*BASE, "parallelism=ddp", "train.global_batch_size=6", "train.micro_batch_size=4", root]
    ).startswith("config key 'train.global_batch_size': ")
    big = refused(
        [
            "model=gpt_1b",
            "train.device=cpu",
            "cluster.gpus_per_node=1",
            "cluster.device_memory_gib=1",
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
            "parallelism.dp_replicate=2",
            root,
        ]
    )
    assert (
        big.startswith("config key 'parallelism': estimated ") and "exceeds the 1.0 GiB usable of 1 GiB on cpu" in big
    )
    two = [*BASE, "cluster.gpus_per_node=2", "parallelism.dp_replicate=4", "train.global_batch_size=16", root]
    assert refused(two, {**JOB, "SLURM_CPUS_ON_NODE": "1"}) == (
        "config key 'cluster.gpus_per_node': needs 2 CPU(s) per node (2 worker(s) x 1 thread(s)) but the allocation "
        "has 1 (SLURM_CPUS_ON_NODE). Fix: submit with --cpus-per-task=2 (lmforge launch --slurm does)"
    )
    assert check_job(two, JOB)[0].parallelism.dp_replicate == 4  # 4 CPUs: enough


def test_gpu_config_refused_on_this_cpu_node_and_its_sbatch_request(tmp_path):
    gpu = [
        "model=tiny",
        "cluster=h100_node",
        "cluster.gpus_per_node=1",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        "parallelism=ddp",
        f"run.root={tmp_path}",
    ]
    assert refused(gpu) == (
        f"node node1 (job 77 prepare): cluster=h100_node names h100 GPUs (train.device=auto) but torch "
        f"{torch.__version__} (torch.version.cuda=None) is a CPU-only build. Fix: install the CUDA build of torch "
        "into the job's environment (on the login node: make install TORCH_VARIANT=cu128, or pip install "
        "torch==<version> --index-url https://download.pytorch.org/whl/cu128 with the job's LMFORGE_PYTHON), or set "
        "train.device=cpu to train on CPU on purpose"
    )
    # What lmforge launch --slurm asks for: the cluster config's GPUs, CPUs and whole nodes.
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate

    need = resources(validate(compose(["+exp=gpt_1b"])), nodes=8)
    assert need.sbatch_args() == ["--gpus-per-node=8", "--cpus-per-task=8", "--exclusive"] and need.nodes == 8
    need = resources(validate(compose(["+exp=gpt_1b", "train.device=cpu", "cluster.cpus_per_task=32"])))
    assert need.sbatch_args() == ["--cpus-per-task=32", "--exclusive"]  # CPU training asks Slurm for no GPU
    from lmforge.launch.slurm import plan, train_script

    assert plan(["+exp=gpt_1b"], nodes=8).command() == [  # lmforge launch --slurm --nodes 8 +exp=gpt_1b
        "sbatch",
        "--nodes=8",
        "--ntasks-per-node=1",
        "--time=60",
        "--signal=B:USR1@120",
        "--requeue",
        "--open-mode=append",
        "--gpus-per-node=8",
        "--cpus-per-task=8",
        "--exclusive",
        str(train_script()),
        "+exp=gpt_1b",
    ]


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
    assert "export LMFORGE_NODES_OVERRIDE=cluster.nodes=2" in ok.stdout.splitlines()
    assert "export LMFORGE_NPROC_PER_NODE=1" in ok.stdout.splitlines()


def test_gpu_allocation_short_of_the_config_is_refused_naming_both():
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.launch.allocation import check_allocation

    cfg = validate(compose(["+exp=gpt_1b"]))  # h100_node: 8 GPUs per node, train.device=auto
    with pytest.raises(ConfigError) as e:
        check_allocation(cfg, {"SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "64"})
    assert str(e.value) == (
        "config key 'cluster.gpus_per_node': is 8 but the allocation has 4 GPU(s) on this node (SLURM_GPUS_ON_NODE). "
        "Fix: submit with --gpus-per-node=8 (lmforge launch --slurm does) or set cluster.gpus_per_node=4"
    )
    check_allocation(cfg, {"SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "64"})  # control: enough of both
    with pytest.raises(ConfigError, match=r"needs 8 CPU\(s\) per node .* has 4 \(SLURM_CPUS_PER_TASK\)"):
        check_allocation(cfg, {"SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "4"})

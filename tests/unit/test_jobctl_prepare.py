"""slurm/train.sh's prepare step (``jobctl prepare``): the checks a job passes, with its real allocation's
environment, before srun starts a worker. Real Hydra composition; the Slurm variables are the ones Slurm sets.
(The same step inside a real Slurm job: tests/slurm/test_slurm_train.py, job G.)
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config.errors import ConfigError
from lmforge.launch.allocation import resources, run_name_override
from lmforge.launch.jobctl import check_job, run_dir_for
from lmforge.runtime.device_contract import DeviceContractError

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
    assert extra == ["cluster.nodes=2"] and cfg.cluster.nodes == 2 and cfg.parallelism.dp_replicate == 2
    cfg, extra = check_job([*follow, "cluster.nodes=2"], JOB)  # given and equal: nothing to add
    assert extra == [] and cfg.parallelism.dp_replicate == 2
    assert refused([*follow, "cluster.nodes=3"]) == (
        "config key 'cluster.nodes': is 3 on the command line but the job has 2 nodes (SLURM_NNODES). Fix: drop "
        "cluster.nodes=3 (the allocation's node count is used) or submit with sbatch --nodes=3"
    )
    # Negative control: without the job's node count the same config plans 1 node and its layout is for 1 rank.
    cfg, extra = check_job(follow, {k: v for k, v in JOB.items() if k != "SLURM_NNODES"})
    assert extra == [] and cfg.parallelism.dp_replicate == 1


def test_a_slurm_job_writes_its_own_run_directory_unless_the_command_line_names_one(tmp_path, capsys, monkeypatch):
    """``+exp=smoke`` sets run.name=smoke: a Slurm job of it gets runs/slurm-<jobid> (said in one line) instead of
    resuming the local smoke run's directory, or sharing one with another job of the preset; a run.name given on
    the command line is kept; outside Slurm the preset's name stands (negative control)."""
    monkeypatch.setenv("SLURM_JOB_ID", JOB["SLURM_JOB_ID"])  # what every process of the job sees
    smoke = ["+exp=smoke", "parallelism=ddp", "train.micro_batch_size=8", "train.threads=1", f"run.root={tmp_path}"]
    cfg, extra = check_job(smoke, JOB)
    assert extra == ["cluster.nodes=2", "run.name=null"]
    assert run_dir_for(cfg) == tmp_path / "slurm-77"
    assert capsys.readouterr().err.splitlines() == [
        "lmforge: run.name=smoke comes from the config's presets, not the command line: this Slurm job writes its own "
        "run directory (slurm-77); give run.name=... on the command line to resume or share a named run"
    ]
    cfg, extra = check_job([*smoke, "run.name=smoke"], JOB)
    assert extra == ["cluster.nodes=2"] and run_dir_for(cfg) == tmp_path / "smoke"
    assert run_name_override(smoke, {}, "smoke") is None  # not a Slurm job: the preset's directory
    assert run_name_override(["model=tiny"], JOB, None) is None  # no name anywhere: slurm-<jobid> already


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

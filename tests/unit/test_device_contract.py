"""The device contract (runtime/device_contract.py) on this CPU-only torch build, with real env vars.

A job that wants GPUs (GPU cluster config, train.device=cuda, a Slurm allocation with GPUs) and finds none
stops at start-up with one line naming node, rank, torch build and fix, exit 2, no traceback, before the
process group exists (a rank 1 of 2 whose rank 0 never comes would otherwise wait in the rendezvous).
Only an explicit train.device=cpu trains on CPU under a GPU cluster config.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.runtime.device_contract import DeviceContractError, DeviceFacts, allocated_gpus, check


def test_this_machine_is_a_cpu_only_build():
    # The exact lines below are those of a CPU-only torch build, which is what this suite runs on.
    assert torch.version.cuda is None and not torch.cuda.is_available()


def test_what_makes_a_job_want_gpus():
    cpu = DeviceFacts(torch.__version__, None, False, 0)
    env = {"SLURMD_NODENAME": "n3", "RANK": "5"}
    # No GPU wanted: nothing is probed, CPU training proceeds.
    assert check("auto", "local", "auto", 1, env=env, facts=cpu) is None
    assert check("cpu", "h100_node", "h100", 8, env={**env, "SLURM_GPUS_ON_NODE": "8"}, facts=cpu) is None
    # train.device=cuda, and an allocation with GPUs under a CPU cluster config (auto device), want them.
    with pytest.raises(DeviceContractError, match=r"^node n3 rank 5: train\.device=cuda but "):
        check("cuda", "local", "auto", 1, env=env, facts=cpu)
    with pytest.raises(
        DeviceContractError,
        match=r"^node n3 rank 5: the allocation has 4 GPU\(s\) on this node "
        r"\(SLURM_GPUS_ON_NODE\) \(train\.device=auto\) but ",
    ):
        check("auto", "local", "auto", 1, env={**env, "SLURM_GPUS_ON_NODE": "4"}, facts=cpu)
    with pytest.raises(DeviceContractError, match=r"allocation has 2 GPU\(s\) on this node \(CUDA_VISIBLE_DEVICES\)"):
        check("auto", "local", "auto", 1, env={**env, "CUDA_VISIBLE_DEVICES": "0,1"}, facts=cpu)
    assert [
        allocated_gpus(e)
        for e in (
            {},
            {"CUDA_VISIBLE_DEVICES": ""},
            {"CUDA_VISIBLE_DEVICES": "NoDevFiles"},
            {"CUDA_VISIBLE_DEVICES": "-1"},
            {"SLURM_GPUS_ON_NODE": "0"},
        )
    ] == [0] * 5


def test_cuda_build_without_driver_and_too_few_gpus():
    env = {"SLURMD_NODENAME": "n1", "RANK": "0", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    no_driver = DeviceFacts("2.13.0+cu128", "12.8", False, 0)
    with pytest.raises(DeviceContractError) as e:
        check("auto", "h100_node", "h100", 8, env=env, facts=no_driver)
    assert str(e.value) == (
        "node n1 rank 0: cluster=h100_node names h100 GPUs (train.device=auto) but torch 2.13.0+cu128 "
        "(torch.version.cuda=12.8) finds no usable CUDA device (no driver or no GPU visible; CUDA_VISIBLE_DEVICES="
        "0,1,2,3). Fix: run on GPU nodes and request them (sbatch --gpus-per-node=8; check nvidia-smi on n1), "
        "or set train.device=cpu to train on CPU on purpose"
    )
    four = DeviceFacts("2.13.0+cu128", "12.8", True, 4)
    with pytest.raises(
        DeviceContractError,
        match=r"sees 4 CUDA device\(s\) for 8 processes per node\. Fix: request "
        r"--gpus-per-node=8 or set cluster\.gpus_per_node=4$",
    ):
        check("auto", "h100_node", "h100", 8, env=env, facts=four)
    assert check("auto", "h100_node", "h100", 4, env=env, facts=four).startswith("cluster=h100_node names h100")

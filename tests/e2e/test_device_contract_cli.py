"""The device contract through lmforge.train: a GPU cluster config without CUDA stops before the process group."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.runtime.device_contract import install_fix

REPO = Path(__file__).resolve().parents[2]


TINY = [
    "model=tiny",
    "train.max_steps=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "logging.console=plain",
    "checkpoint.every_steps=0",
]


CPU_BUILD = f"torch {torch.__version__} (torch.version.cuda=None)"


FIX = f"Fix: {install_fix()}, or set train.device=cpu to train on CPU on purpose"


CLEAN = {
    k: v
    for k, v in os.environ.items()
    if k
    not in (
        "SLURM_GPUS_ON_NODE",
        "CUDA_VISIBLE_DEVICES",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURMD_NODENAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(tmp_path: Path, overrides, env, data_cache: Path) -> subprocess.CompletedProcess:
    full = {**CLEAN, "PYTHONPATH": str(REPO / "platform"), "LMFORGE_DATA_CACHE": str(data_cache), **env}
    return subprocess.run(
        [sys.executable, "-m", "lmforge.train", *TINY, f"run.root={tmp_path}", *overrides],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(600)
def test_gpu_cluster_config_without_cuda_stops_before_the_process_group(tmp_path, data_cache):
    # Rank 1 of a 2-rank job whose rank 0 never starts: reaching the rendezvous would hang until the timeout.
    env = {
        "SLURMD_NODENAME": "gpu-node-7",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = train(tmp_path, ["cluster=h100_node", "parallelism=ddp", "train.global_batch_size=4"], env, data_cache)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"lmforge: node gpu-node-7 rank 1: cluster=h100_node names h100 GPUs (train.device=auto) but {CPU_BUILD} "
        f"is a CPU-only build. {FIX}"
    ], proc.stderr
    assert "Traceback" not in proc.stderr

    # Negative control: the same job with an explicit train.device=cpu passes the contract and trains (1 rank).
    ok = train(
        tmp_path,
        ["cluster=h100_node", "train.device=cpu", "run.name=cpu-on-purpose"],
        {"SLURMD_NODENAME": "gpu-node-7"},
        data_cache,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (tmp_path / "cpu-on-purpose" / "DONE").exists()

"""The device contract: a job that asks for GPUs gets them, or stops at start-up saying why and how to fix it.

A job *wants GPUs* when

* ``train.device=cuda``, or
* ``train.device=auto`` and the cluster config names a GPU kind (``cluster.device`` other than auto/cpu, e.g.
  ``cluster=h100_node``), or
* ``train.device=auto`` and the Slurm allocation has GPUs (``SLURM_GPUS_ON_NODE`` > 0, or a
  ``CUDA_VISIBLE_DEVICES`` naming devices).

Such a job needs a CUDA build of torch, a driver, and at least ``nproc_per_node`` visible devices; otherwise
:func:`check` raises :class:`DeviceContractError` naming node, rank, torch build and the fix. ``train.device=cpu``
is the one way to train on CPU under a GPU cluster config. Called once per worker before the process group
exists (``trainer.Trainer``) and once per job in slurm/train.sh's prepare step (``launch.jobctl prepare``).
Layer 0: plain arguments, no Hydra.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from lmforge.runtime.env_vars import environment

CPU_KINDS = ("auto", "cpu", "")
NO_DEVICES = ("", "-1", "none", "nodevfiles")  # CUDA_VISIBLE_DEVICES values that hide every GPU


class DeviceContractError(RuntimeError):
    """The job wants GPUs this process cannot use; ``str()`` is the one line to print."""


@dataclass(frozen=True)
class DeviceFacts:
    """What this process can use: torch build, CUDA runtime availability, visible device count."""

    torch_version: str
    cuda_build: Optional[str]  # torch.version.cuda; None on a CPU-only build
    cuda_available: bool
    device_count: int

    @classmethod
    def probe(cls) -> "DeviceFacts":
        import torch

        available = bool(torch.cuda.is_available())
        return cls(torch.__version__, torch.version.cuda, available, torch.cuda.device_count() if available else 0)


def allocated_gpus(env: Mapping[str, str]) -> int:
    """GPUs Slurm (or the user) gave this node: SLURM_GPUS_ON_NODE, else the devices CUDA_VISIBLE_DEVICES names."""
    raw = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            pass
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip().lower() in NO_DEVICES:
        return 0
    return len([d for d in visible.split(",") if d.strip()])


def gpu_reason(device: str, cluster_name: str, cluster_device: str, env: Mapping[str, str]) -> Optional[str]:
    """Why this job wants GPUs (None: it does not)."""
    if device == "cpu":
        return None
    if device == "cuda":
        return "train.device=cuda"
    if cluster_device.lower() not in CPU_KINDS:
        return f"cluster={cluster_name} names {cluster_device} GPUs (train.device={device})"
    gpus = allocated_gpus(env)
    if gpus:
        source = "SLURM_GPUS_ON_NODE" if env.get("SLURM_GPUS_ON_NODE", "").strip() else "CUDA_VISIBLE_DEVICES"
        return f"the allocation has {gpus} GPU(s) on this node ({source}) (train.device={device})"
    return None


def install_fix() -> str:
    return (
        "install the CUDA build of torch into the job's environment (on the login node: make install "
        "TORCH_VARIANT=cu128, or pip install torch==<version> --index-url https://download.pytorch.org/whl/cu128 "
        "with the job's LMFORGE_PYTHON)"
    )


def check(
    device: str,
    cluster_name: str,
    cluster_device: str,
    nproc_per_node: int,
    *,
    env: Optional[Mapping[str, str]] = None,
    facts: Optional[DeviceFacts] = None,
    where: str = "",
) -> Optional[str]:
    """Raise DeviceContractError when the job wants GPUs it cannot use. Returns why GPUs are wanted (None: CPU)."""
    env = environment() if env is None else env
    reason = gpu_reason(device, cluster_name, cluster_device, env)
    if reason is None:
        return None
    facts = facts or DeviceFacts.probe()
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    rank = env.get("RANK", "-")
    who = where or f"node {node} rank {rank}"
    build = f"torch {facts.torch_version} (torch.version.cuda={facts.cuda_build})"
    cpu_fix = "or set train.device=cpu to train on CPU on purpose"
    if facts.cuda_build is None:
        raise DeviceContractError(f"{who}: {reason} but {build} is a CPU-only build. Fix: {install_fix()}, {cpu_fix}")
    if not facts.cuda_available:
        raise DeviceContractError(
            f"{who}: {reason} but {build} finds no usable CUDA device (no driver or no GPU visible; "
            f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}). Fix: run on GPU nodes and request "
            f"them (sbatch --gpus-per-node={nproc_per_node}; check nvidia-smi on {node}), {cpu_fix}"
        )
    if facts.device_count < nproc_per_node:
        raise DeviceContractError(
            f"{who}: {reason} but {build} sees {facts.device_count} CUDA device(s) for {nproc_per_node} processes "
            f"per node. Fix: request --gpus-per-node={nproc_per_node} or set cluster.gpus_per_node="
            f"{facts.device_count}"
        )
    return reason

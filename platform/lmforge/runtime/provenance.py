"""What produced a run: code version, packages, hosts, devices, layout, scheduler ids, environment."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from lmforge.runtime.file_modes import write_text
from lmforge.runtime.secrets import redact, redacted_environ

PACKAGES = (
    "lmforge",
    "torch",
    "numpy",
    "hydra-core",
    "omegaconf",
    "megatron-core",
    "wandb",
    "deepspeed",
    "tokenizers",
    "transformers",
    "submitit",
)
ENV_PREFIXES = (
    "SLURM_",
    "TORCHELASTIC_",
    "LMFORGE_",
    "NCCL_",
    "TORCH_",
    "GLOO_",
    "CUDA_",
    "OMP_",
    "MASTER_",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_",
    "GROUP_",
    "ROLE_",
    "WANDB_",
    "HF_",
    "PYTHON",
)


def git_state(path: Path) -> dict[str, Any]:
    def run(*args: str) -> Optional[str]:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = run("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = run("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status)}


def package_versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def toolchain() -> dict[str, Optional[str]]:
    """The versions a run's speed and numerics depend on: Python, torch, CUDA and NCCL (None without CUDA)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):  # a build without NCCL
            nccl = None
    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}


def node_list() -> list[str]:
    """The job's nodes: Slurm's node list when under Slurm (compressed, as ``SLURM_JOB_NODELIST`` has it), else this
    host."""
    nodes = os.environ.get("SLURM_JOB_NODELIST")
    return [nodes] if nodes else [socket.gethostname()]


def device_names() -> list[str]:
    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ["cpu"]


def collect(layout: Optional[dict] = None, hostnames: Optional[list[str]] = None) -> dict[str, Any]:
    source = Path(__file__).resolve().parents[3]
    return {
        "git": git_state(source),
        "python": sys.version.split()[0],
        "packages": package_versions(),
        "hostnames": hostnames or [socket.gethostname()],
        "devices": device_names(),
        "threads": torch.get_num_threads(),
        "layout": layout or {},
        "slurm": {
            k: v
            for k, v in os.environ.items()
            if k
            in (
                "SLURM_JOB_ID",
                "SLURM_ARRAY_JOB_ID",
                "SLURM_ARRAY_TASK_ID",
                "SLURM_RESTART_COUNT",
                "SLURM_JOB_NODELIST",
                "SLURM_NNODES",
            )
        },
        "torchrun": {
            k: v
            for k, v in os.environ.items()
            if k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
        },
        "argv": redact(list(sys.argv)),
        "env": redacted_environ(ENV_PREFIXES),
    }


def write(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    write_text(tmp, json.dumps(redact(info), indent=1, sort_keys=True))
    os.replace(tmp, path)

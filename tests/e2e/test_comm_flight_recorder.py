"""torch reads the flight-recorder variables the comm presets export, in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lmforge.comm.transport_env import comm_environment
from lmforge.config.compose import compose
from lmforge.config.validate import validate

PRESETS = ("auto", "cpu_gloo", "infiniband", "roce", "ethernet", "single_node")


def preset(name: str, *more: str):
    return validate(compose([f"comm={name}", *more]), world_size=1).comm


@pytest.fixture(scope="module")
def presets():
    """Every preset, composed by Hydra and validated (all checks) once for the module."""
    return {name: preset(name) for name in PRESETS}


FLIGHT_RECORDER_PROBE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_torch_reads_the_exported_flight_recorder_variables_without_a_warning(presets, tmp_path):
    """A real one-process gloo group with a collective, in a fresh process (torch warns once per process), under
    the preset's environment prints nothing; the older spelling (negative control) prints torch's warning."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_FR_"))}

    def stderr_with(env):
        proc = subprocess.run(
            [sys.executable, "-c", FLIGHT_RECORDER_PROBE],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=100,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    dumps = tmp_path / "dumps"
    assert stderr_with(comm_environment(presets["infiniband"], dumps)) == ""
    older = comm_environment(presets["infiniband"], dumps, torch_version="2.7.1")
    assert (
        "Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE instead"
        in stderr_with(older)
    )

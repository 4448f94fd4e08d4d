"""`make install TORCH_VARIANT=...` picks the torch wheel: a dry run (`make -n`) of the real Makefile, no download.

auto (default) takes the CPU wheel on a machine without nvidia-smi (as this one: PyPI's Linux torch wheel is the
CUDA build); cpu and cuNNN take the PyTorch index of that variant, so a GPU environment can be built on a login node without GPUs; the
variant a venv was built with stays its default; anything else stops make with one line.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_n(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(REPO), "install", f"VENV={venv}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def torch_lines(proc: subprocess.CompletedProcess) -> list:
    return [line for line in proc.stdout.splitlines() if " torch==" in line or ".torch-variant" in line]


def test_torch_variant_selects_the_pip_command(tmp_path):
    assert shutil.which("nvidia-smi") is None  # auto's expectation below is that of a machine without GPUs
    venv = tmp_path / "venv"
    py = f"{venv}/bin/python"
    assert torch_lines(make_n(venv)) == [
        f"{py} -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        f"echo auto > {venv}/.torch-variant",
    ]
    assert torch_lines(make_n(venv, "TORCH_VARIANT=cpu"))[0] == (
        f"{py} -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    )
    cu = make_n(venv, "TORCH_VARIANT=cu128")
    assert (
        torch_lines(cu)[0] == f"{py} -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
    )
    assert f"python3 -m venv  {venv}" in cu.stdout  # its own venv, not the system's site-packages
    assert f"touch {venv}/.installed-cu128" in cu.stdout

    # A venv built for cu128 keeps that variant as the default (make test / make smoke do not reinstall torch).
    venv.mkdir()
    (venv / ".torch-variant").write_text("cu128\n")
    assert torch_lines(make_n(venv))[0].endswith("--index-url https://download.pytorch.org/whl/cu128")

    # Negative controls: an unknown variant stops make (exit 2) before any command, naming the value.
    for bad in ("gpu", "cu12", "cuda"):
        proc = make_n(venv, f"TORCH_VARIANT={bad}")
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert (
            f"*** TORCH_VARIANT={bad} is not auto, cpu or cuNNN (e.g. cu128); see the Makefile's header.  Stop."
            in proc.stderr
        ), proc.stderr

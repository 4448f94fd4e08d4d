"""benchmarks/gpu_wheels.sh fetches, for the GPU machine (which reaches no package index), the versions this project
runs with: each ``NAME==VERSION`` it names is the version installed here from pyproject's pins, so the GPU check
imports what the tests ran."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_wheels.sh"


def pinned(text: str) -> dict:
    return dict(re.findall(r"\b([A-Za-z][A-Za-z0-9_.-]*)==([0-9][0-9A-Za-z.+-]*)", text))


def test_the_wheels_are_the_versions_installed_here():
    pins = pinned(SCRIPT.read_text())
    assert {"torchao", "omegaconf", "antlr4-python3-runtime"} <= set(pins), pins
    assert {name: version(name) for name in pins} == pins
    # negative control: a version that drifted is caught by the same comparison
    drifted = pinned(SCRIPT.read_text().replace("torchao==0.18.0", "torchao==0.17.0"))
    assert {name: version(name) for name in drifted} != drifted

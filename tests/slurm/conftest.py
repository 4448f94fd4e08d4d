"""Fixtures for tests on a real Slurm cluster (4 nodes, one network namespace each; see cluster.py).

Without root or slurm-wlm the tests skip with the reason (in CI a skip is a failure: .ci/run installs
slurm-wlm and runs as root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from cluster import SlurmCluster, unavailable_reason  # noqa: E402

# One tiny 2-rank data-parallel run, used by every test: the Slurm jobs must reproduce its losses exactly.
MAX_STEPS = 30
TRAIN_OVERRIDES = [
    "model=tiny",
    "parallelism=ddp",
    f"train.max_steps={MAX_STEPS}",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.threads=1",
    "train.device=cpu",
    "train.eval_every=0",
    "checkpoint.every_steps=10",
    "checkpoint.keep_last=5",
    "logging.every_steps=1",
    "logging.console=plain",
    "cluster.gpus_per_node=1",
    "metrics.straggler_every=5",
]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"), nodes=4)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def job_env(data_cache) -> Dict[str, str]:
    path = os.pathsep.join([str(REPO / "platform"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return {
        "LMFORGE_REPO": str(REPO),
        "LMFORGE_PYTHON": sys.executable,
        "PYTHONPATH": path,
        "LMFORGE_DATA_CACHE": str(data_cache),
    }


def train_losses(run_dir: Path) -> Dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice (replayed after a restart) keeps its last value."""
    out: Dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[int(rec["step"])] = rec["loss"]
    return out


def events(run_dir: Path) -> List[dict]:
    return [
        r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "event"
    ]


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory, job_env) -> Dict[int, float]:
    """The same config as a local 2-process run through ``lmforge launch`` (torchrun), no faults."""
    root = tmp_path_factory.mktemp("local-ref")
    cmd = [
        sys.executable,
        "-m",
        "lmforge.cli",
        "launch",
        "--nproc",
        "2",
        *TRAIN_OVERRIDES,
        f"run.root={root}",
        "run.name=ref",
    ]
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, **job_env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"local reference failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    losses = train_losses(root / "ref")
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return losses

"""The ``slurm`` entries of tests/doc_commands.yaml on the Slurm test cluster (tests/slurm/cluster.py: 4 CPU
nodes, one network namespace each), submitted as printed from a sandbox checkout.

Every entry's layout is checked at the world slurm/train.sh gives it (2 nodes x 1 CPU rank; an entry's ``world:``
where its jobs have another, e.g. one replica group of a torchft run); the kill drill, the
first entry, is submitted and must complete with every step trained after its rank was killed and restarted. The
other drills run in tests/slurm/test_slurm_train.py with the suite's tiny model (a job each of the smoke model
costs minutes of 2 cores)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "slurm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import SlurmCluster, unavailable_reason  # noqa: E402
from doc_commands import hydra_overrides, load_manifest  # noqa: E402
from doc_sandbox import make_sandbox  # noqa: E402

ENTRIES = [e for e in load_manifest() if e["class"] == "slurm"]
CLUSTER_START_S = 300  # starting the 4 nodes' daemons, on a loaded machine
WORLD = 2  # slurm/train.sh's #SBATCH --nodes=2, one rank a node on the test cluster's CPU nodes (cluster=local)


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["command"][:70] for e in ENTRIES])
def test_slurm_entry_validates_on_the_test_clusters_layout(entry):
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate

    validate(compose(hydra_overrides(entry["command"])), world_size=entry.get("world", WORLD))


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"), nodes=4)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(CLUSTER_START_S + max(e.get("timeout_s", 900) for e in ENTRIES))
def test_kill_drill_runs_as_printed_and_recovers(slurm_cluster, tmp_path, data_cache):
    entry = next(e for e in ENTRIES if "fault.drill.kill_step" in e["command"])
    env = make_sandbox(tmp_path, data_cache)
    env["LMFORGE_PYTHON"] = str(cpu_counting_python(tmp_path / "python-cpu", tmp_path / "cpu.log"))
    words = shlex.split(entry["command"])
    assert words[0] == "sbatch"
    job = slurm_cluster.sbatch(words[1:], cwd=tmp_path, env=env)
    try:
        slurm_cluster.wait_state(job, {"COMPLETED"}, timeout=entry.get("timeout_s", 900))
    except AssertionError as e:
        logs = "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(tmp_path.glob("slurm-*")))
        raise AssertionError(f"{e}\n{logs}") from None
    run = tmp_path / "runs" / "drill-kill"
    assert json.loads((run / "DONE").read_text())["step"] == 40
    assert (run / "drills").is_dir() and any((run / "drills").iterdir()), "the kill drill never fired"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"] for r in steps if r.get("kind") == "train"}
    assert max(trained) == 40
    print(f"doc commands: slurm kill drill: {job_cpu_s(tmp_path / 'cpu.log'):.0f} CPU-s in the job's processes")


def cpu_counting_python(path: Path, log: Path) -> Path:
    """A stand-in for LMFORGE_PYTHON that runs this Python and appends the CPU time of everything it waited for
    (a torchrun agent waits for its workers) to ``log``: the job's processes run under slurmd, outside this
    test's own accounting."""
    path.write_text(f'#!/bin/bash\n"{sys.executable}" "$@"\nrc=$?\ntimes >> "{log}"\nexit $rc\n')
    path.chmod(0o755)
    return path


def job_cpu_s(log: Path) -> float:
    """The sum of the user + system times ``times`` wrote (``1m2.500s 0m0.250s`` a line)."""
    total = 0.0
    for word in log.read_text().split() if log.exists() else []:
        minutes, seconds = word.rstrip("s").split("m")
        total += int(minutes) * 60 + float(seconds)
    return total


def test_the_smoke_layout_without_ddp_is_refused_at_that_world():
    """The negative control: +exp=smoke as it stands (micro batch 16 = global batch 16) cannot split over 2 ranks."""
    from lmforge.config.compose import compose
    from lmforge.config.errors import ConfigError
    from lmforge.config.validate import validate

    with pytest.raises(ConfigError):
        validate(compose(["+exp=smoke", "fault.drill.kill_step=150", "fault.drill.kill_rank=1"]), world_size=WORLD)

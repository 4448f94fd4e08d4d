"""A save killed half-way never becomes a checkpoint: the restarted job loads the previous one.

Two real gloo ranks (``python -m lmforge.train`` with RANK/WORLD_SIZE/MASTER_* set, DDP over 2 ranks) train
4 steps, checkpointing every 2. Each rank of the first launch runs ``pausing_train.py 4 1``, which installs
``checkpoint.fault_injection.install_save_pause(4, 1)`` and then calls ``lmforge.train.main``: the save of step
4 freezes after rank 0 wrote its shard and before rank 1 writes its own. The test asserts the partial
``.tmp-step-00000004`` (1 shard file, no metadata, no COMPLETE) and the complete ``step-00000002`` exist,
SIGKILLs both ranks, restarts them without the hook, and checks that step 2 is the checkpoint loaded, the
partial directory is cleaned up, and the run finishes with a complete step-4 checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port

PAUSING_TRAIN = Path(__file__).resolve().parent / "pausing_train.py"

ARGS = [
    "model=tiny",
    "parallelism=ddp",
    "train.max_steps=4",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "train.threads=1",
    "train.device=cpu",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=3",
]


def start_ranks(root: Path, tag: str, pause=None, world: int = 2):
    """``pause=(step, after_shards)``: every rank installs that save pause (pausing_train.py) before training."""
    port = free_port()
    procs = []
    entry = ["-m", "lmforge.train"] if pause is None else [str(PAUSING_TRAIN), *map(str, pause)]
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LMFORGE_RUN_ID": "crash",
        }
        log = open(root / f"{tag}-rank{rank}.log", "w")
        cmd = [sys.executable, *entry, f"run.root={root}", "run.name=crash", *ARGS]
        procs.append(
            subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    return procs


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def logs(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(root.glob("*.log")))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_kill_mid_save_then_restart_loads_previous_checkpoint(tmp_path, data_cache):
    ckpts = tmp_path / "crash" / "checkpoints"
    partial = ckpts / ".tmp-step-00000004"
    procs = start_ranks(tmp_path, "first", pause=(4, 1))
    try:
        deadline = time.monotonic() + 200
        while not ((partial / "PAUSED.rank1").exists() and (partial / "__0_0.distcp").exists()):
            assert all(p.poll() is None for p in procs), f"a rank exited before the pause\n{logs(tmp_path)}"
            assert time.monotonic() < deadline, f"the save never reached the pause\n{logs(tmp_path)}"
            time.sleep(0.2)
        time.sleep(0.5)  # let rank 0 finish flushing its shard; it then blocks waiting for rank 1
        shards = sorted(p.name for p in partial.glob("*.distcp"))
        assert shards == ["__0_0.distcp"], shards  # k=1 of 2 shards written
        assert not (partial / "COMPLETE").exists() and not (partial / "state.json").exists()
        assert not (partial / ".metadata").exists()
        assert (ckpts / "step-00000002" / "COMPLETE").exists()
        assert not (ckpts / "step-00000004").exists()
    finally:
        kill_all(procs)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    assert partial.is_dir()  # the crash left the partial directory behind

    procs = start_ranks(tmp_path, "second")
    try:
        for p in procs:
            assert p.wait(timeout=200) == 0, logs(tmp_path)
    finally:
        kill_all(procs)
    out = (tmp_path / "second-rank0.log").read_text()
    assert "resumed from step 2" in out, logs(tmp_path)
    events = [json.loads(line) for line in (tmp_path / "crash" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "resume"] == [2]
    steps = [e["step"] for e in events if e.get("kind") == "train"]
    assert steps == [1, 2, 3, 4, 3, 4]  # the second launch redid steps 3 and 4 from the step-2 checkpoint
    losses = [e["loss"] for e in events if e.get("kind") == "train"]
    assert losses[4:] == losses[2:4]  # and got the same losses: model, optimizer, RNG and data position restored
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000004"]
    assert len(list((ckpts / "step-00000004").glob("*.distcp"))) == 2
    assert (tmp_path / "crash" / "DONE").exists()

"""A real training run that diverges: the loss guard skips the bad updates, then stops with exit 45 and a
pinned reference to the last checkpoint before the divergence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_divergence_skips_updates_then_stops_with_pinned_checkpoint(tmp_path, data_cache):
    cmd = [
        sys.executable,
        "-m",
        "lmforge.train",
        "model=tiny",
        "train.max_steps=30",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.eval_every=0",
        "train.threads=1",
        "train.device=cpu",
        "optim.lr=1e30",
        "optim.warmup_steps=0",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=1",
        "fault.max_consecutive_skips=4",
        "logging.console=plain",
        f"run.root={tmp_path}",
        "run.name=div",
    ]
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "LMFORGE_DATA_CACHE": str(data_cache)},
    )
    assert proc.returncode == 45, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = tmp_path / "div"
    events = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "event"]
    skipped = [e for e in events if e["event"] == "skipped_step"]
    assert [e["consecutive"] for e in skipped] == [1, 2, 3, 4]
    assert "non-finite" in skipped[0]["cause"]
    first_bad = skipped[0]["step"]
    diverged = [e for e in events if e["event"] == "diverged"]
    assert len(diverged) == 1 and diverged[0]["first_bad_step"] == first_bad
    ref = run / "checkpoints" / f"step-{first_bad - 1:08d}"
    assert diverged[0]["checkpoint"] == str(ref)
    assert (ref / "PINNED").read_text().startswith("last checkpoint before divergence")  # survived keep_last=1
    assert f"training diverged: 4 skipped steps in a row since step {first_bad}" in proc.stderr
    assert not (run / "DONE").exists()

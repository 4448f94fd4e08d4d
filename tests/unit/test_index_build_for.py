"""``index_build.build_for``: a run's megatron-core indices built before any process group, under the cache
lock. Two processes race on a fresh index directory: exactly one builds, the other waits on the lock (no
shared process group, so no collective timeout) and loads the same files; both read identical samples."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(400)
def test_two_racing_builders_one_builds_the_other_waits_on_the_lock_and_loads(tmp_path, data_cache):
    cache = tmp_path / "cache"
    shutil.copytree(data_cache / "shards", cache / "shards")  # prepared shards and tokenizer, no index yet
    shutil.copytree(data_cache / "tokenizers", cache / "tokenizers")
    overrides = [
        "model=tiny",
        "model.seq_len=64",
        "train.max_steps=7",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.seed=4321",
        "~data.sources.code",
        f"data.cache_dir={cache}",
        f"run.root={tmp_path / 'runs'}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "index_builders", json.dumps(overrides), str(tmp_path / f"ready{i}"), str(go)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 240
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    go.write_text("go")
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert len(out.strip().splitlines()) == 1, out  # nothing else on stdout (the prepare step evaluates it)
        results.append(json.loads(out))
    builders = [r for r in results if r["built"]]
    waiters = [r for r in results if not r["built"]]
    assert len(builders) == 1 and len(waiters) == 1, results
    # train passes + valid sets of two sources, each a GPTDataset, plus the blend: all from the one builder
    assert len(builders[0]["built"]) >= 3 and waiters[0]["present"] == builders[0]["present"]
    assert waiters[0]["lock_wait_s"] > 0.2  # it waited for the build, on the lock
    assert results[0]["samples"] == results[1]["samples"]
    assert not any(r["process_group_after"] for r in results)  # its private one-process group is gone


def test_build_for_refuses_inside_a_process_group(tmp_path, data_cache):
    import torch.distributed as dist

    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.index_build import build_for

    cfg = validate(compose(["model=tiny", f"data.cache_dir={data_cache}", f"run.root={tmp_path}"]))
    # Other data tests in this process may already hold one (tests/data_support.py ensure_world); then use it.
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="before the process group exists"):
            build_for(cfg)
    finally:
        if mine:
            dist.destroy_process_group()

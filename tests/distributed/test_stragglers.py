"""Straggler detection on 4 real gloo ranks through the training entry point (tiny model, 8 steps).

Rank 2 does 1 s of extra compute before every step (``fault.drill.slow_s``). Its peers wait for it inside the
gradient reduction (DDP) or the first all-gather (FSDP2), so every rank's *wall* step time is the same (the old
rule could never fire); the ranks' compute times (loop top to the first blocking collective: the last local
gradient under DDP, the root forward pre-hook under FSDP2) tell rank 2 apart, and only rank 2 is named. The same
DDP run without the slow rank names nobody (at a threshold above what sharing 2 cores between 4 ranks does by
itself). The three trainings share one launch of the ranks (train_entries).
"""

from __future__ import annotations

import json
import socket

import pytest
from distributed.train_entries import section
from harness import run_ranks

pytestmark = pytest.mark.distributed

# 4 ranks share 2 cores here: time-slicing alone leaves two ranks' compute windows 2-3x the others' (measured:
# 0.033 s against a median of 0.014 s in an even run under load), while the drill's 1 s of extra work stands 20x and
# more above its peers. A production threshold (1.5 by default) assumes a device per rank.
THRESHOLD = 5.0


LAYOUTS = {  # layout overrides, where the compute window ends
    "ddp": (["parallelism=ddp", "parallelism.dp_replicate=4"], "last local gradient"),
    "fsdp": (["parallelism=fsdp", "parallelism.dp_shard=4"], "forward pre-hook"),
}


def argv(root, name, extra, layout):
    return [
        "model=tiny",
        "model.seq_len=32",
        *LAYOUTS[layout][0],
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.threads=1",
        "train.max_steps=8",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.eval_every=0",
        "logging.every_steps=4",
        "logging.console=none",
        "checkpoint.enabled=false",
        "metrics.straggler_every=4",
        f"metrics.straggler_threshold={THRESHOLD}",
        "~data.sources.code",
        "~data.sources.reference",
        f"run.root={root}",
        f"run.name={name}",
        *extra,
    ]


SLOW = ["fault.drill.slow_rank=2", "fault.drill.slow_s=1.0"]
RUNS = {"slow-ddp": ("ddp", SLOW), "slow-fsdp": ("fsdp", SLOW), "even": ("ddp", [])}  # trained in this order


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The three trainings in one launch of 4 ranks (train_entries: the ranks start once): for each, the ranks'
    console output and the run's metrics records."""
    root = tmp_path_factory.mktemp("stragglers")
    argvs = [argv(root, name, extra, layout) for name, (layout, extra) in RUNS.items()]
    ranks = run_ranks(
        "distributed.train_entries:train_entries",
        4,
        {"argvs": argvs},
        timeout=900,
        env={"LMFORGE_DATA_CACHE": str(data_cache)},
    )
    out = {}
    for i, name in enumerate(RUNS):
        records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines() if line]
        out[name] = ([section(r.output, i) for r in ranks], records)
    return out


@pytest.mark.timeout(960)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_the_rank_doing_extra_work_is_named_and_only_it(runs, layout):
    from lmforge.fault.straggler import find_stragglers

    outputs, records = runs[f"slow-{layout}"]
    events = [r for r in records if r.get("event") == "straggler"]
    assert [(e["step"], e["slow_rank"]) for e in events] == [(4, 2), (8, 2)], events
    for e in events:
        assert e["compute_time_s"] > 1.0 and e["compute_time_s"] > THRESHOLD * e["median_s"]
        # The old rule on wall step times: synchronous collectives made them equal, it names nobody.
        assert find_stragglers(e["step_times_s"], 1.5) == [], e["step_times_s"]
        assert "rank 2 is a straggler" in e["cause"] and LAYOUTS[layout][1] in e["cause"]
    host = socket.gethostname()
    assert [(e["rank"], e["host"]) for e in events] == [(2, host)] * 2  # the slow rank's, not rank 0's that reports
    assert f"[lmforge fault] straggler rank=2 host={host} step=4: rank 2 is a straggler on host {host}" in outputs[0]
    gathered = [r["compute_time_max_over_median"] for r in records if r.get("kind") == "train" and r["step"] in (4, 8)]
    assert len(gathered) == 2 and min(gathered) > THRESHOLD


@pytest.mark.timeout(960)
def test_the_same_run_without_a_slow_rank_names_nobody(runs):
    outputs, records = runs["even"]
    assert [r for r in records if r.get("event") == "straggler"] == []
    gathered = [r["compute_time_max_over_median"] for r in records if r.get("kind") == "train" and r["step"] in (4, 8)]
    assert len(gathered) == 2 and max(gathered) < THRESHOLD, gathered
    assert not any("[lmforge fault] straggler" in out or "is a straggler" in out for out in outputs)

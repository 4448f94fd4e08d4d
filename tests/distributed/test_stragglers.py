"""Straggler detection on 4 real gloo ranks through the training entry point (tiny model, 8 steps).

Rank 2 does 1 s of extra compute before every step (``fault.drill.slow_s``). Its peers wait for it inside the
gradient reduction (DDP) or the first all-gather (FSDP2), so every rank's *wall* step time is the same (the old
rule could never fire); the ranks' compute times (loop top to the first blocking collective: the last local
gradient under DDP, the root forward pre-hook under FSDP2) tell rank 2 apart, and only rank 2 is named. The same
DDP run without the slow rank names nobody.
"""
from __future__ import annotations

import json

import pytest

from harness import run_ranks

pytestmark = pytest.mark.distributed

THRESHOLD = 2.0


LAYOUTS = {  # layout overrides, where the compute window ends
    "ddp": (["parallelism=ddp", "parallelism.dp_replicate=4"], "last local gradient"),
    "fsdp": (["parallelism=fsdp", "parallelism.dp_shard=4"], "forward pre-hook"),
}


def run(tmp_path, data_cache, name, extra, layout="ddp"):
    argv = ["model=tiny", "model.seq_len=32", *LAYOUTS[layout][0], "comm=cpu_gloo",
            "train.device=cpu", "train.threads=1", "train.max_steps=8", "train.micro_batch_size=2",
            "train.global_batch_size=8", "train.eval_every=0", "logging.every_steps=4", "logging.console=none",
            "checkpoint.enabled=false", "metrics.straggler_every=4", f"metrics.straggler_threshold={THRESHOLD}",
            "~data.sources.code", "~data.sources.reference", f"run.root={tmp_path}", f"run.name={name}", *extra]
    ranks = run_ranks("distributed.parallel_worker:train_entry", 4, {"argv": argv}, timeout=300,
                      env={"LMFORGE_DATA_CACHE": str(data_cache)})
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines() if line]
    return ranks, records


@pytest.mark.timeout(360)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_the_rank_doing_extra_work_is_named_and_only_it(tmp_path, data_cache, layout):
    from lmforge.fault.straggler import find_stragglers

    ranks, records = run(tmp_path, data_cache, "slow", ["fault.drill.slow_rank=2", "fault.drill.slow_s=1.0"], layout)
    events = [r for r in records if r.get("event") == "straggler"]
    assert [(e["step"], e["slow_rank"]) for e in events] == [(4, 2), (8, 2)], events
    for e in events:
        assert e["compute_time_s"] > 1.0 and e["compute_time_s"] > THRESHOLD * e["median_s"]
        # The old rule on wall step times: synchronous collectives made them equal, it names nobody.
        assert find_stragglers(e["step_times_s"], 1.5) == [], e["step_times_s"]
        assert "rank 2 is a straggler" in e["cause"] and LAYOUTS[layout][1] in e["cause"]
    assert "[lmforge fault] straggler rank=0 step=4: rank 2 is a straggler" in ranks[0].output
    gathered = [r["compute_time_max_over_median"] for r in records if r.get("kind") == "train" and r["step"] in (4, 8)]
    assert len(gathered) == 2 and min(gathered) > THRESHOLD


@pytest.mark.timeout(360)
def test_the_same_run_without_a_slow_rank_names_nobody(tmp_path, data_cache):
    ranks, records = run(tmp_path, data_cache, "even", [])
    assert [r for r in records if r.get("event") == "straggler"] == []
    gathered = [r["compute_time_max_over_median"] for r in records if r.get("kind") == "train" and r["step"] in (4, 8)]
    assert len(gathered) == 2 and max(gathered) < THRESHOLD, gathered
    assert not any("straggler" in r.output for r in ranks)

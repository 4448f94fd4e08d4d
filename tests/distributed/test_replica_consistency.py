"""Silent data corruption is caught: one flipped bit of one parameter on one rank of a real DDP (3 ranks) and
HSDP (2 x 2) run is found at the next replica check, which names the ranks and the tensor, pins the last
checkpoint before the corruption and stops every rank with exit 47. With three replicas the minority rank's host is
named (the node a requeue excludes, lmforge.fault.bad_nodes); a pair (HSDP's replicate dimension) names no host and
excludes nobody. The control run without the flip checks the same replicas and trains to the end."""

from __future__ import annotations

import json
import socket

import pytest
from harness import run_ranks

from lmforge.fault.bad_nodes import at_fault, short_host

pytestmark = pytest.mark.distributed

BASE = [
    "model=tiny",
    "model.seq_len=32",
    "comm=cpu_gloo",
    "train.device=cpu",
    "train.threads=1",
    "train.max_steps=6",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=1",
    "fault.consistency_every=2",
    "~data.sources.code",
    "~data.sources.reference",
]
FIRST_PARAM = "tok_embeddings.weight"


def _run(tmp_path, data_cache, name, world, extra, timeout):
    argv = BASE + extra + [f"run.root={tmp_path}", f"run.name={name}"]
    results = run_ranks(
        "distributed.consistency_ranks:train_exit_code",
        world,
        {"argv": argv},
        timeout=timeout,
        env={"LMFORGE_DATA_CACHE": str(data_cache)},
    )
    run = tmp_path / name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    events = [r for r in records if r.get("kind") == "event"]
    return [r.value["code"] for r in results], run, records, events, [r.output for r in results]


def _assert_stopped(run, events, outputs, codes, world, suspects, group, flipped_rank):
    assert codes == [47] * world, outputs
    drill = [e for e in events if e["event"] == "drill"]
    assert len(drill) == 1 and drill[0]["rank"] == flipped_rank and drill[0]["step"] == 3
    mismatch = [e for e in events if e["event"] == "replica_mismatch"]
    assert len(mismatch) == 1, events
    m = mismatch[0]
    assert (m["step"], m["ranks"], m["replicas"], m["tensors"], m["last_good_step"]) == (
        4,
        suspects,
        group,
        [FIRST_PARAM],
        2,
    )
    corrupted = [e for e in events if e["event"] == "corrupted"]
    ref = run / "checkpoints" / "step-00000002"
    assert len(corrupted) == 1 and corrupted[0]["ranks"] == suspects and corrupted[0]["checkpoint"] == str(ref)
    named = len(suspects) < len(group)  # a minority: the check tells which replica is wrong
    host = short_host(socket.gethostname())  # every rank runs here
    assert corrupted[0]["hosts"] == ([socket.gethostname()] if named else []), corrupted[0]
    reason = "silent data corruption on its replica at step 4 (fault.consistency_every)"
    assert at_fault(run, [host], {}, straggler_limit=0) == ({host: reason} if named else {})
    assert (ref / "PINNED").read_text().startswith("last checkpoint before the replica mismatch found at step 4")
    assert not (run / "checkpoints" / "step-00000004").exists()  # no new save of corrupt weights
    assert not (run / "DONE").exists()
    line = (
        f"silent data corruption: data-parallel replicas differ at step 4 (last agreeing check at step 2); "
        f"suspect rank(s) {', '.join(map(str, suspects))}"
    )
    assert all(line in out for out in outputs)
    assert all("Traceback" not in out for out in outputs)


@pytest.mark.timeout(600)
def test_ddp_bit_flip_is_caught_and_control_trains_on(tmp_path, data_cache):
    flip = ["fault.drill.bitflip_step=3", "fault.drill.bitflip_rank=1"]
    codes, run, records, events, outputs = _run(
        tmp_path,
        data_cache,
        "flip",
        3,
        ["parallelism=ddp", "parallelism.dp_replicate=3", "train.global_batch_size=6", *flip],
        timeout=280,
    )
    _assert_stopped(run, events, outputs, codes, 3, [1], [0, 1, 2], flipped_rank=1)
    assert (
        "rank(s) 1 differ from the other replicas (0, 2)"
        in next(e for e in events if e["event"] == "replica_mismatch")["cause"]
    )
    assert all(f"suspect rank(s) 1 on host(s) {socket.gethostname()};" in out for out in outputs)

    # Negative control: the same run without the flip checks at steps 2, 4, 6 and finishes.
    codes, run, records, events, outputs = _run(
        tmp_path, data_cache, "control", 2, ["parallelism=ddp", "train.global_batch_size=4"], timeout=280
    )
    assert codes == [0, 0], outputs
    assert not [e for e in events if e["event"] in ("replica_mismatch", "corrupted", "drill")]
    checked = [r["step"] for r in records if r.get("kind") == "train" and "replica_check_s" in r]
    assert checked == [2, 4, 6]
    assert (run / "DONE").exists()


@pytest.mark.timeout(600)
def test_hsdp_bit_flip_names_the_replica_pair_of_that_shard(tmp_path, data_cache):
    # Mesh (dp_replicate=2, dp_shard=2): rank 3 holds the same shard as rank 1; ranks 0 and 2 still agree.
    codes, run, records, events, outputs = _run(
        tmp_path,
        data_cache,
        "hsdp",
        4,
        ["parallelism=hsdp", "train.global_batch_size=8", "fault.drill.bitflip_step=3", "fault.drill.bitflip_rank=3"],
        timeout=560,
    )
    _assert_stopped(run, events, outputs, codes, 4, [1, 3], [1, 3], flipped_rank=3)
    assert "ranks 1, 3 disagree (no majority" in next(e for e in events if e["event"] == "replica_mismatch")["cause"]
    assert all("suspect rank(s) 1, 3 (no majority: no host can be named, none is excluded)" in out for out in outputs)
    assert [r["step"] for r in records if r.get("kind") == "train" and "replica_check_s" in r] == [2]

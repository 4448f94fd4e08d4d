"""Collectives on real 2-rank gloo groups: the bench CLI, the training preflight, overlap measured on DDP
with and without bucketed overlap, the kept traces, and the W&B (offline) read-back of both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_ranks
from wandb_read import history, leet

from lmforge.comm.bench import OPS, bus_factor, load_result
from lmforge.comm.overlap import aggregate, analyze_trace
from lmforge.comm.profiling import STEP_ANNOTATION

pytestmark = pytest.mark.distributed

TRAIN = [
    "model=tiny",
    "parallelism=ddp",
    "comm=cpu_gloo",
    "train.max_steps=4",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.eval_every=0",
    "checkpoint.enabled=false",
    "logging.console=none",
    "train.threads=1",
    "metrics.profile_every=2",
    "parallelism.ddp_bucket_cap_mb=1",
]


def records(run_dir: Path, kind: str) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, data_cache):
    """One launch of 2 ranks: the same 4-step DDP run twice (steps 2 and 4 profiled), first with bucketed overlap
    (plus the bus-bandwidth preflight and W&B logging on rank 0), then with one all-reduce after backward; then
    `lmforge comm bench` on the same two ranks."""
    root = tmp_path_factory.mktemp("overlap")
    runs = [
        {
            "overrides": TRAIN
            + [
                f"run.root={root}",
                "parallelism.overlap_grad_reduce=true",
                "comm.preflight=true",
                "comm.preflight_max_bytes=65536",
                "comm.preflight_iters=2",
                "comm.preflight_floor_gbps=0.0001",
                "logging.wandb.mode=offline",
            ],
            "run_dir": str(root / "overlap_True"),
            "wandb_dir": str(root / "wandb"),
        },
        {
            "overrides": TRAIN + [f"run.root={root}", "parallelism.overlap_grad_reduce=false"],
            "run_dir": str(root / "overlap_False"),
        },
        {
            "overrides": TRAIN
            + [
                f"run.root={root}",
                "comm.preflight=true",
                "comm.preflight_max_bytes=4096",
                "comm.preflight_iters=1",
                "comm.preflight_floor_gbps=1000",
                "comm.preflight_floor_ops='all_reduce,broadcast'",
            ],
            "run_dir": str(root / "floor"),
        },
    ]
    bench_argv = [
        "--max-bytes",
        "64K",
        "--factor",
        "8",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--floor-gbps",
        "1000",
        "--out",
        str(root / "bench.json"),
        "comm=cpu_gloo",
    ]
    results = run_ranks(
        "distributed.comm_ranks:train",
        2,
        {"runs": runs, "bench_argv": bench_argv},
        timeout=300,
        env={"LMFORGE_DATA_CACHE": str(data_cache), "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    return {
        "root": root,
        True: root / "overlap_True",
        False: root / "overlap_False",
        "floor": root / "floor",
        "results": results,
    }


@pytest.mark.timeout(400)
def test_bench_on_two_ranks_writes_its_table_and_fails_the_floor(ddp_runs):
    root = ddp_runs["root"]
    # 1000 GB/s floor: every rank reports the same failure (exit status 1)
    assert [r.value["bench_rc"] for r in ddp_runs["results"]] == [1, 1]
    result = load_result(root / "bench.json")
    assert (result.backend, result.world_size, result.device, result.iters) == ("gloo", 2, "cpu", 3)
    assert result.ops() == list(OPS)
    for op in OPS:
        assert [r.size_bytes for r in result.rows_of(op)] == [8, 64, 512, 4096, 32768, 65536]
    for r in result.rows:
        assert r.count == r.size_bytes // 4 and r.time_us > 0
        assert r.algbw_gbps == pytest.approx(r.size_bytes / (r.time_us * 1e-6) / 1e9)
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * bus_factor(r.op, 2))
    assert result.failures and result.failures[0].startswith("all_reduce peak bus bandwidth")
    table = (root / "bench.txt").read_text()
    assert "busbw(GB/s)" in table and "small-message latency" in table and "FAIL: all_reduce" in table


@pytest.mark.timeout(400)
def test_bucketed_ddp_overlaps_more_than_allreduce_after_backward(ddp_runs):
    fractions = {}
    for overlap in (True, False):
        recs = records(ddp_runs[overlap], "overlap")
        assert [r["step"] for r in recs] == [2, 4]
        for r in recs:
            assert r["comm/mode"] == "cpu" and r["comm/total_ms"] > 0
            assert 0 <= r["comm/exposed_ms"] <= r["comm/total_ms"]
            assert r["comm/all_reduce/total_ms"] > 0
        fractions[overlap] = sum(r["comm/overlap_fraction"] for r in recs) / len(recs)
    # One all-reduce after backward: the training thread waits for all of it.
    assert fractions[False] < 0.05, fractions
    assert fractions[True] > fractions[False] + 0.02, fractions


@pytest.mark.timeout(400)
def test_traces_are_kept_and_reanalysis_matches_the_logged_numbers(ddp_runs):
    run_dir = ddp_runs[True]
    traces = sorted(p.name for p in (run_dir / "traces").iterdir())
    assert traces == [
        "step0000002-rank0.json",
        "step0000002-rank1.json",
        "step0000004-rank0.json",
        "step0000004-rank1.json",
    ]
    logged = records(run_dir, "overlap")[-1]
    per_rank = [analyze_trace(run_dir / "traces" / f"step0000004-rank{r}.json", STEP_ANNOTATION, r) for r in (0, 1)]
    again = aggregate(per_rank, step=4)
    for key in ("comm/total_ms", "comm/exposed_ms", "comm/overlap_fraction", "comm/all_reduce/exposed_ms"):
        assert again[key] == pytest.approx(logged[key]), key
    env = json.loads((run_dir / "comm_env.json").read_text())
    assert env["preset"] == "cpu_gloo" and env["backend"] == "gloo" and env["world_size"] == 2
    assert env["variables"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] in (
        "3",
        os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    )


@pytest.mark.timeout(400)
def test_training_preflight_logs_bus_bandwidth(ddp_runs):
    run_dir = ddp_runs[True]
    (bench,) = records(run_dir, "comm_bench")
    assert bench["step"] == 0 and bench["comm_bench/passed"] == 1.0 and bench["comm_bench/world_size"] == 2
    for op in OPS:
        assert bench[f"comm_bench/{op}/busbw_gbps"] > 0 and bench[f"comm_bench/{op}/latency_us"] > 0
    result = load_result(run_dir / "comm_bench.json")
    assert result.peak_busbw("all_reduce") == pytest.approx(bench["comm_bench/all_reduce/busbw_gbps"])
    assert not (ddp_runs[False] / "comm_bench.json").exists()  # preflight off by default


@pytest.mark.timeout(400)
def test_preflight_below_the_floor_stops_the_job_before_training(ddp_runs):
    messages = [r.value["preflight_failed"] for r in ddp_runs["results"]]
    assert [len(m) for m in messages] == [1, 1]  # both ranks stop, with the same verdict
    msg = messages[0][0]
    assert msg.startswith("comm preflight failed (cpu_gloo preset, gloo, 2 ranks): all_reduce peak bus bandwidth ")
    assert "< floor 1000 GB/s; broadcast peak bus bandwidth " in msg and "Fix: check the fabric" in msg
    run_dir = ddp_runs["floor"]
    assert records(run_dir, "train") == []  # no training step ran
    (event,) = [r for r in records(run_dir, "event") if r["event"] == "comm_preflight_failed"]
    assert event["cause"].startswith("all_reduce peak bus bandwidth")
    assert load_result(run_dir / "comm_bench.json").failures == event["cause"].split("; ")


@pytest.mark.timeout(400)
def test_wandb_offline_read_back_has_overlap_and_bandwidth(ddp_runs):
    run_dir = ddp_runs[True]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    (wb_run,) = (ddp_runs["root"] / "wandb" / "wandb").glob("offline-run-*")
    wandb_bin = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_bin), "leet", "inspect", "--summary", "--json", str(wb_run)],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    summary = json.loads(out)["summary"]
    logged = records(run_dir, "overlap")[-1]
    assert summary["comm/overlap_fraction"] == pytest.approx(logged["comm/overlap_fraction"])
    assert summary["comm/all_reduce/exposed_ms"] == pytest.approx(logged["comm/all_reduce/exposed_ms"])
    bench = records(run_dir, "comm_bench")[0]
    assert summary["comm_bench/all_reduce/busbw_gbps"] == pytest.approx(bench["comm_bench/all_reduce/busbw_gbps"])
    bench_table = json.loads((wb_run / "files" / summary["comm_bench/table"]["path"]).read_text())
    assert bench_table["columns"] == ["op", "size_bytes", "time_us", "algbw_gbps", "busbw_gbps"]
    assert {row[0] for row in bench_table["data"]} == set(OPS)
    overlap_table = json.loads((wb_run / "files" / summary["comm/overlap_table"]["path"]).read_text())
    assert overlap_table["columns"] == ["rank", "collective", "total_ms", "exposed_ms", "overlap_fraction"]
    assert {(row[0], row[1]) for row in overlap_table["data"]} >= {(0, "all_reduce"), (1, "all_reduce"), (0, "all")}


@pytest.mark.timeout(400)
def test_the_trainers_own_wandb_run_has_every_communication_panels_series(ddp_runs):
    """The overlap record through the real W&B sink keeps its comm/* names (metrics/series.py), so every panel of
    the workspace's multi-rank sections (`lmforge wandb workspace`) plots a series this 2-rank run logged."""
    from lmforge.metrics.wandb_workspace import MULTI_RANK, panel_series, unmatched

    (wb_run,) = (ddp_runs[True] / "wandb").glob("offline-run-*")
    rows = history(leet(wb_run))
    names = {k for row in rows for k in row}
    assert unmatched(panel_series(MULTI_RANK), names) == [], sorted(names)
    logged = {r["step"]: r["comm/overlap_fraction"] for r in records(ddp_runs[True], "overlap")}
    shown = {row["trainer/step"]: row["comm/overlap_fraction"] for row in rows if "comm/overlap_fraction" in row}
    assert shown == logged and sorted(shown) == [2, 4]

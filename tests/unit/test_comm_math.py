"""Bus-bandwidth arithmetic (nccl-tests definitions) and the overlap calculator on hand-made traces."""

from __future__ import annotations

import gzip
import json

import pytest

from lmforge.comm.bench import (
    BenchResult,
    BenchRow,
    algbw_gbps,
    aligned_size,
    bus_factor,
    busbw_gbps,
    parse_size,
    size_sweep,
)
from lmforge.comm.overlap import aggregate, analyze_trace, collective_kind, length, subtract, union


def test_bus_bandwidth_matches_nccl_tests_definitions():
    # 1 GB in 10 ms on 8 ranks: algbw = 100 GB/s; nccl-tests' busbw factors 2(n-1)/n, (n-1)/n, (n-1)/n, (n-1)/n, 1.
    size, t, n = 10**9, 0.010, 8
    assert algbw_gbps(size, t) == pytest.approx(100.0)
    assert busbw_gbps("all_reduce", size, t, n) == pytest.approx(175.0)
    assert busbw_gbps("all_gather", size, t, n) == pytest.approx(87.5)
    assert busbw_gbps("reduce_scatter", size, t, n) == pytest.approx(87.5)
    assert busbw_gbps("all_to_all", size, t, n) == pytest.approx(87.5)
    assert busbw_gbps("broadcast", size, t, n) == pytest.approx(100.0)
    # On 2 ranks an all-reduce moves as much per link as its buffer: busbw = algbw; one rank moves nothing.
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_gather", 2) == 0.5
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 2)


def test_sizes():
    assert parse_size("8") == 8 and parse_size("4K") == 4096 and parse_size("16M") == 16 * 2**20
    assert parse_size("1G") == 2**30 and parse_size("64MB") == 64 * 2**20
    assert size_sweep(8, 64) == [8, 16, 32, 64]
    assert size_sweep(8, 100, factor=4) == [8, 32, 100]
    assert aligned_size(8, 4) == 16 and aligned_size(1000, 3) == 996


def _result(rows):
    return BenchResult(
        backend="gloo",
        world_size=2,
        device="cpu",
        iters=1,
        warmup=0,
        rows=[BenchRow(op, s, s // 4, t * 1e6, algbw_gbps(s, t), busbw_gbps(op, s, t, 2)) for op, s, t in rows],
    )


def test_floor_summary_and_latency():
    r = _result(
        [("all_reduce", 8, 20e-6), ("all_reduce", 2**20, 1e-3), ("broadcast", 8, 10e-6), ("broadcast", 2**20, 2e-3)]
    )
    assert r.peak_busbw("all_reduce") == pytest.approx(2**20 / 1e-3 / 1e9)
    assert r.latency_us("all_reduce") == pytest.approx(20.0) and r.latency_us("broadcast") == pytest.approx(10.0)
    assert r.check_floor(1.0, ["all_reduce"]) == [] and r.passed
    failures = r.check_floor(2.0, ["all_reduce", "broadcast"])
    assert failures == [
        "all_reduce peak bus bandwidth 1.05 GB/s < floor 2 GB/s",
        "broadcast peak bus bandwidth 0.524 GB/s < floor 2 GB/s",
    ]
    assert not r.passed and "FAIL" in r.table()
    s = r.summary()
    assert s["comm_bench/all_reduce/busbw_gbps"] == pytest.approx(1.048576)
    assert s["comm_bench/broadcast/latency_us"] == pytest.approx(10.0) and s["comm_bench/passed"] == 0.0


def test_interval_algebra():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert length(subtract([(0, 10), (20, 30)], [(25, 26)])) == 19


def X(name, ts, dur, tid, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}


def hand_made_cpu_trace():
    """Training thread 1, gloo worker threads 7/8, times in us.

    compute on thread 1: [0,100] and [150,300], minus the collective launch c10d::allreduce_ [90,100]
    gloo:all_reduce [50,200] on thread 7: exposed where thread 1 computes nothing: [90,150] = 60 of 150
    gloo:all_gather [280,400] on thread 8: exposed [300,400] = 100 of 120
    union of comm [50,200]+[280,400] = 270, exposed 160 -> overlap 1 - 160/270
    """
    return [
        X("lmforge.step", 0, 400, 1, cat="user_annotation"),
        X("aten::mm", 0, 100, 1),
        X("aten::add", 10, 20, 1),  # nested ops count once
        X("c10d::allreduce_", 90, 10, 1),
        X("aten::mm", 150, 150, 1),
        X("gloo:all_reduce", 50, 150, 7, cat="user_annotation"),
        X("gloo:all_gather", 280, 120, 8, cat="user_annotation"),
        X("aten::copy_", 60, 30, 7),  # an op on a worker thread is not training compute
        X("gloo:broadcast", 500, 50, 7, cat="user_annotation"),  # outside the step window: ignored
        {"ph": "i", "name": "marker", "ts": 5, "tid": 1},
    ]


def test_overlap_calculator_on_a_hand_made_cpu_trace(tmp_path):
    stats = analyze_trace(hand_made_cpu_trace(), "lmforge.step")
    assert stats.mode == "cpu"
    assert stats.total_us == pytest.approx(270) and stats.exposed_us == pytest.approx(160)
    assert stats.overlap_fraction == pytest.approx(1 - 160 / 270)
    assert stats.compute_us == pytest.approx(240) and stats.step_us == 400
    assert set(stats.per_kind) == {"all_reduce", "all_gather"}
    ar, ag = stats.per_kind["all_reduce"], stats.per_kind["all_gather"]
    assert (ar.total_us, ar.exposed_us, ar.overlap_fraction) == pytest.approx((150, 60, 0.6))
    assert (ag.total_us, ag.exposed_us, ag.overlap_fraction) == pytest.approx((120, 100, 1 / 6))
    # The same numbers from the file a run keeps (plain and gzipped Chrome trace).
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": hand_made_cpu_trace()}, fh)
    assert analyze_trace(path, "lmforge.step").exposed_us == pytest.approx(160)


def test_overlap_calculator_on_a_hand_made_gpu_trace():
    """GPU timeline: NCCL kernels on a comm stream vs compute kernels on the compute stream; CPU events ignored."""
    events = [
        X("lmforge.step", 0, 1000, 1, cat="user_annotation"),
        X("aten::mm", 0, 1000, 1),  # CPU side: not what counts on a GPU
        X("nccl:all_reduce", 100, 5, 1, cat="user_annotation"),
        X("sm90_xmma_gemm_bf16", 0, 400, 7, cat="kernel"),
        X("Memcpy DtoD", 400, 50, 7, cat="gpu_memcpy"),
        X("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 300, 300, 20, cat="kernel"),
        X("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", 700, 100, 20, cat="kernel"),
        X("sm90_xmma_gemm_bf16", 750, 100, 7, cat="kernel"),
    ]
    stats = analyze_trace(events, "lmforge.step")
    assert stats.mode == "gpu"
    # all_reduce [300,600]: hidden by [300,450], exposed [450,600] = 150; reduce_scatter [700,800]: exposed [700,750]
    assert stats.per_kind["all_reduce"].exposed_us == pytest.approx(150)
    assert stats.per_kind["reduce_scatter"].exposed_us == pytest.approx(50)
    assert stats.total_us == pytest.approx(400) and stats.exposed_us == pytest.approx(200)
    assert stats.overlap_fraction == pytest.approx(0.5)


def test_no_communication_means_no_fraction_and_aggregate_over_ranks():
    quiet = analyze_trace([X("lmforge.step", 0, 10, 1, cat="user_annotation"), X("aten::mm", 0, 10, 1)], "lmforge.step")
    assert quiet.total_us == 0 and quiet.overlap_fraction is None
    a = analyze_trace(hand_made_cpu_trace(), "lmforge.step", rank=0)
    rec = aggregate([a, quiet], step=7)
    assert rec["kind"] == "overlap" and rec["step"] == 7
    assert rec["comm/total_ms"] == pytest.approx(0.135) and rec["comm/exposed_ms"] == pytest.approx(0.080)
    assert rec["comm/overlap_fraction"] == pytest.approx(1 - 160 / 270)
    assert rec["comm/all_gather/overlap_fraction"] == pytest.approx(1 / 6)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("gloo:all_reduce", "all_reduce"),
        ("gloo:allgather_coalesced", "all_gather"),
        ("gloo:reduce_scatter_tensor_coalesced", "reduce_scatter"),
        ("nccl:_all_gather_base", "all_gather"),
        ("gloo:all_to_all", "all_to_all"),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t(x)", "all_gather"),
        ("ncclDevKernel_SendRecv(x)", "send_recv"),
        ("aten::all_reduce_like", None),
        ("c10d::allreduce_", None),
    ],
)
def test_collective_names(name, kind):
    assert collective_kind(name) == kind

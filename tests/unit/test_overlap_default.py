"""The overlap probe on by default where there is something to overlap (comm/profiling.py): the interval it
resolves to, the few traces a rank keeps, and a profiled step left out of throughput and MFU (metrics/meter.py)."""

from __future__ import annotations

from lmforge.comm.profiling import AUTO_PROFILE_EVERY, OverlapProbe, profile_interval, prune_traces
from lmforge.metrics.meter import IntervalMeter


def test_auto_profiles_multi_process_runs_only_and_explicit_values_win():
    assert profile_interval(None, 1) == 0 and profile_interval(None, 2) == AUTO_PROFILE_EVERY == 500
    assert profile_interval(0, 64) == 0 and profile_interval(7, 1) == 7
    probe = OverlapProbe(profile_interval(None, 8), "unused", "cpu")
    assert [s for s in range(1, 2001) if probe.due(s)] == [500, 1000, 1500, 2000]


def test_a_rank_keeps_the_newest_traces_and_leaves_the_other_ranks_alone(tmp_path):
    for step in (500, 1000, 1500, 2000):
        for rank in (0, 1):
            (tmp_path / f"step{step:07d}-rank{rank}.json").write_text("{}")
    gone = prune_traces(tmp_path, rank=0, keep=3)
    assert [p.name for p in gone] == ["step0000500-rank0.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"step{s:07d}-rank0.json" for s in (1000, 1500, 2000)]
        + [f"step{s:07d}-rank1.json" for s in (500, 1000, 1500, 2000)]
    )


def test_a_profiled_step_counts_in_no_throughput_and_is_marked():
    now = [0.0]
    meter = IntervalMeter(1000, 1.0, world_size=1, tokens_per_step=100, clock=lambda: now[0])
    meter.start()
    for _ in range(3):  # three plain steps of 1 s
        now[0] += 1.0
        meter.step_done()
    with meter.excluded():  # the profiled step: 5 s under the profiler
        now[0] += 5.0
    meter.step_left_out()
    record = meter.measure()
    assert (record["step_time_s"], record["tokens_per_s"], record["interval_steps"]) == (1.0, 100.0, 3)
    assert record["profiled_steps"] == 1
    now[0] += 2.0
    meter.step_done()
    assert "profiled_steps" not in meter.measure()  # the next interval had none


def test_the_console_shows_a_profiled_steps_overlap_in_one_line_and_no_bare_step_lines():
    import io

    from lmforge.metrics.sinks import PlainConsoleSink

    out = io.StringIO()
    sink = PlainConsoleSink(out)
    sink.log(
        {"kind": "overlap", "step": 500, "comm/overlap_fraction": 0.531, "comm/exposed_ms": 42.8, "comm/total_ms": 91.2}
    )
    sink.log({"kind": "goodput", "step": 500, "fraction": 0.9})  # fault/goodput.py prints its own line
    sink.log({"kind": "comm_bench", "step": 0, "comm_bench/all_reduce/busbw_gbps": 1.0})  # the preflight's table
    assert out.getvalue().splitlines() == [
        "overlap step 500: fraction 0.53, exposed 42.8 ms of 91.2 ms communication (profiled step, left out of tokens/s)"
    ]

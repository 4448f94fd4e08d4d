"""The global sample stream is the same for DP=1 and DP=2 (two real gloo ranks building the index together)."""

from __future__ import annotations

import pytest
from data_support import THREE_SOURCES, make_stream, step_records
from harness import run_ranks

SEQ, MICRO, GLOBAL, STEPS, N = 64, 4, 16, 12, 2048


@pytest.mark.timeout(240)
def test_dp1_and_dp2_consume_the_same_global_stream(data_cache):
    # The ranks go first: rank 0 builds the index (under the cache lock) while rank 1 waits, then loads it.
    ranks = run_ranks(
        "data_support:rank_stream",
        2,
        {"cache": str(data_cache), "steps": STEPS, "seq_len": SEQ, "micro": MICRO, "global_batch": GLOBAL, "n": N},
        timeout=200,
    )
    single = step_records(make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, N, seed=4321), STEPS)
    assert [r.value["rank"] for r in ranks] == [0, 1]
    for step in range(STEPS):
        merged = sorted(ranks[0].value["steps"][step] + ranks[1].value["steps"][step], key=lambda rec: rec["i"])
        assert merged == single[step], f"step {step} differs between DP=1 and DP=2"
        # each rank read its own, disjoint slice
        mine = {rec["i"] for rec in ranks[0].value["steps"][step]}
        assert mine.isdisjoint(rec["i"] for rec in ranks[1].value["steps"][step]) and len(mine) == GLOBAL // 2


@pytest.mark.timeout(120)
def test_an_index_cache_other_ranks_cannot_see_is_refused(tmp_path):
    shared = str(tmp_path / "shared")
    ok = run_ranks("data_support:rank_check_visible", 2, {"caches": [shared, shared]}, timeout=90)
    assert [r.value for r in ok] == ["visible", "visible"]
    split = run_ranks(
        "data_support:rank_check_visible",
        2,
        {"caches": [str(tmp_path / "node0"), str(tmp_path / "node1")]},
        timeout=90,
        check=False,
    )
    for r in split:
        assert r.error and "config key 'data.cache_dir'" in r.error and "is not shared: ranks [1] cannot see" in r.error

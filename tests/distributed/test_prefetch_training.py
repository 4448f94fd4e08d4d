"""Training with prefetch workers gives bit-identical losses (a real training process)."""

from __future__ import annotations

import pytest
from harness import run_ranks


@pytest.mark.timeout(300)
def test_trainer_losses_are_bit_identical_with_prefetch(tmp_path, data_cache):
    (rank,) = run_ranks(
        "prefetch_ranks:train_with_workers",
        1,
        {"root": str(tmp_path), "cache": str(data_cache), "workers": [0, 2], "steps": 4},
        timeout=240,
    )
    sync, prefetched = rank.value["0"], rank.value["2"]
    assert sync["consumed"] == [8, 16, 24, 32] and len(sync["loss"]) == 4
    assert all(0 < x < 20 for x in sync["loss"]) and sync["loss"][0] != sync["loss"][-1]
    for key in ("loss", "grad_norm", "consumed"):
        assert prefetched[key] == sync[key], key  # floats from JSON: equal means bit-identical
    # fit() closed the stream and its threads; a stream left open still let the process exit (daemon threads).
    assert prefetched["prefetcher_after_fit"] is False and prefetched["threads_after_fit"] == []
    assert prefetched["threads_left_open"] == ["lmforge-data-0", "lmforge-data-1"]

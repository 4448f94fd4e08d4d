"""Context parallelism (parallel/context_parallel.py) on real gloo ranks, against the single-process run.

The parity harness of test_parallel_parity.py (tiny GQA GPT, seq_len 32, 5 AdamW steps, clipping far below the
real gradient norm, the shared single-process reference): every cp layout must reproduce the reference losses
within 1e-5, pre-clip gradient norms within 5e-5 relative, the eval loss, and the data consumption (cp ranks of a
group read the same samples). Each launch also checks the attention kernel itself (both exchanges against full
SDPA: values and q/k/v gradients) and the 2-rank one runs the negative control: a ring whose ranks send their K/V
chunks swapped must fail parity.
"""
from __future__ import annotations

from typing import List

import pytest

from distributed.test_parallel_parity import WQ, assert_parity, placement, _run

pytestmark = pytest.mark.distributed
CP_WORKER = "distributed.context_parallel_worker:run_cases"
KERNEL_TOL = 1e-5  # fp32 attention values and gradients of unit-normal inputs (measured ~1e-6)


@pytest.fixture(scope="module")
def two_rank_runs(parity_samples) -> List[dict]:
    cases = {"kernel": {"kernel": True},
             "cp2_ring": {"overrides": ["parallelism=cp2"]},
             "cp2_allgather_ac": {"overrides": ["parallelism=cp2", "parallelism.cp_kv_exchange=allgather",
                                                "parallelism.activation_checkpointing=full"]},
             "cp2_wrong_exchange": {"overrides": ["parallelism=cp2"], "wrong_exchange": True}}
    return _run(2, cases, parity_samples, timeout=300, worker=CP_WORKER)


@pytest.fixture(scope="module")
def four_rank_runs(parity_samples) -> List[dict]:
    cases = {"kernel": {"kernel": True},
             "cp2_dp2": {"overrides": ["parallelism=cp2_dp2"]},
             "cp2_tp2_sp": {"overrides": ["parallelism=cp2_tp2"]}}
    return _run(4, cases, parity_samples, timeout=400, worker=CP_WORKER)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["cp2_ring", "cp2_allgather_ac"])
def test_context_parallel_parity(two_rank_runs, reference, case):
    assert_parity(case, two_rank_runs, reference)
    # cp ranks hold replicas: FSDP shards the weights over dp_shard x cp.
    p = placement(two_rank_runs, case, WQ)
    assert p["mesh"] == ["dp_shard_cp"] and p["placements"] == ["S(0)"] and p["local"] == [32, 64]


@pytest.mark.timeout(500)
def test_context_parallel_attention_is_exact_at_cp2_and_cp4(two_rank_runs, four_rank_runs):
    for world, runs in ((2, two_rank_runs), (4, four_rank_runs)):
        for out in runs:
            for exchange, err in out["kernel"].items():
                assert err < KERNEL_TOL, f"cp{world} {exchange}: max |difference| from full SDPA {err}"


@pytest.mark.timeout(500)
def test_negative_control_wrong_kv_exchange_fails_parity(two_rank_runs, reference):
    """The same harness with each rank sending its two K/V chunks swapped: parity must catch it."""
    with pytest.raises(AssertionError, match="loss"):
        assert_parity("cp2_wrong_exchange", two_rank_runs, reference)
    for out in two_rank_runs:  # wrong from the first forward on, not by rounding
        r = out["cp2_wrong_exchange"]
        assert abs(r["losses"][0] - reference["losses"][0]) > 1e-3, f"rank {r['rank']}: {r['losses'][0]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["cp2_dp2", "cp2_tp2_sp"])
def test_context_parallel_composes_with_fsdp_and_tensor_parallel(four_rank_runs, reference, case):
    assert_parity(case, four_rank_runs, reference)
    p = placement(four_rank_runs, case, WQ)
    if case == "cp2_dp2":  # sharded 4 ways over dp_shard x cp
        assert p["mesh"] == ["dp_shard_cp"] and p["placements"] == ["S(0)"] and p["local"] == [16, 64]
    else:  # heads split over tp, then rows over cp
        assert p["mesh"] == ["dp_shard_cp", "tp"] and p["placements"][1] == "S(0)" and p["local"] == [16, 64]

"""Context parallelism (parallel/context_parallel.py) on real gloo ranks, against the single-process run.

The parity harness of test_parallel_parity.py (tiny GQA GPT, seq_len 32, 5 AdamW steps, clipping far below the
real gradient norm, the shared single-process reference): every cp layout must reproduce the reference losses
within 1e-5, pre-clip gradient norms within 5e-5 relative, the eval loss, and the data consumption (cp ranks of a
group read the same samples). The launch also checks the attention kernel itself (both exchanges against full
SDPA: values and q/k/v gradients), runs the negative control (a ring whose ranks send their K/V chunks swapped
must miss the reference loss by far more than the tolerance) and saves a checkpoint that is resumed under cp2 and
dp2. cp2 x FSDP 2 (all-gather exchange, full AC), cp2 x TP+SP 2 and the cp4 kernel run in test_parallel_parity.py's
4-rank launch (test_two_dimensional_parity, test_context_parallel_attention_kernel_is_exact_at_cp4).
"""
from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from distributed.test_parallel_parity import STEPS, WQ, assert_parity, placement, _run
from harness import run_ranks

pytestmark = pytest.mark.distributed
CP_WORKER = "distributed.context_parallel_worker:run_cases"
KERNEL_TOL = 1e-5  # fp32 attention values and gradients of unit-normal inputs (measured ~1e-6)


@pytest.fixture(scope="module")
def cp2_checkpoint(tmp_path_factory) -> Path:
    """Where the cp2 ring case saves its state after the 5 steps (test_cp2_checkpoint_resumes_...)."""
    return tmp_path_factory.mktemp("cp2") / "ckpt"


@pytest.fixture(scope="module")
def two_rank_runs(parity_samples, cp2_checkpoint) -> List[dict]:
    cases = {"kernel": {"kernel": True},
             "cp2_ring": {"overrides": ["parallelism=cp2"], "save_to": str(cp2_checkpoint)},
             # one step: a wrong exchange is wrong from the first forward on
             "cp2_wrong_exchange": {"overrides": ["parallelism=cp2"], "wrong_exchange": True, "steps": 1}}
    return _run(2, cases, parity_samples, timeout=300, worker=CP_WORKER)


@pytest.mark.timeout(500)
def test_context_parallel_parity_cp2_ring(two_rank_runs, reference):
    case = "cp2_ring"
    assert_parity(case, two_rank_runs, reference)
    # cp ranks hold replicas: FSDP shards the weights over dp_shard x cp.
    p = placement(two_rank_runs, case, WQ)
    assert p["mesh"] == ["dp_shard_cp"] and p["placements"] == ["S(0)"] and p["local"] == [32, 64]


@pytest.mark.timeout(500)
def test_context_parallel_attention_kernel_is_exact_at_cp2(two_rank_runs):
    """Both K/V exchanges against full SDPA (values, q/k/v gradients); cp4 runs in test_parallel_parity's 4-rank
    launch (test_context_parallel_attention_kernel_is_exact_at_cp4)."""
    for out in two_rank_runs:
        for exchange, err in out["kernel"].items():
            assert err < KERNEL_TOL, f"cp2 {exchange}: max |difference| from full SDPA {err}"


@pytest.mark.timeout(500)
def test_negative_control_wrong_kv_exchange_fails_parity(two_rank_runs, reference):
    """The same harness with each rank sending its two K/V chunks swapped: the first step's loss is off by far
    more than parity's 1e-5 (by more than 1e-3) on every rank, where the right exchange matches."""
    for out in two_rank_runs:
        wrong, right = out["cp2_wrong_exchange"], out["cp2_ring"]
        assert abs(right["losses"][0] - reference["losses"][0]) < 1e-5
        assert abs(wrong["losses"][0] - reference["losses"][0]) > 1e-3, f"rank {wrong['rank']}: {wrong['losses'][0]}"


@pytest.mark.timeout(500)
def test_cp2_checkpoint_resumes_under_cp2_and_dp2(two_rank_runs, cp2_checkpoint, parity_samples, reference):
    """DCP reshards across cp sizes: the cp2 run's checkpoint (FSDP over cp) loads under cp2 and under dp2 (DDP,
    cp1), and the next step's loss is the same on both, after the samples of the 5 saved steps."""
    assert (cp2_checkpoint / f"step-{STEPS:08d}").is_dir()
    resumed = run_ranks("distributed.parallel_worker:resume_cases", 2,
                        {"samples": parity_samples, "steps": STEPS, "checkpoint": str(cp2_checkpoint),
                         "cases": {"cp2": {"overrides": ["parallelism=cp2"]},
                                   "dp2": {"overrides": ["parallelism=ddp"]}}}, timeout=240)
    same_layout = resumed[0].value["cp2"]["loss"]
    for r in resumed:
        for name, out in r.value.items():
            assert abs(out["loss"] - same_layout) < 1e-6, f"{name} rank {r.rank}: next-step loss {out['loss']} " \
                f"after loading the cp2 checkpoint vs {same_layout} under cp2"
    expected = list(range(STEPS * 8, STEPS * 8 + 8))
    assert sorted(resumed[0].value["cp2"]["consumed"]) == expected  # cp ranks read the whole step's samples
    assert sorted(i for r in resumed for i in r.value["dp2"]["consumed"]) == expected
    assert same_layout < reference["losses"][0] - 0.1  # trained weights were loaded, not the initial ones

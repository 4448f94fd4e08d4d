"""Context parallelism (parallel/context_parallel.py) on real gloo ranks, against the single-process run.

The parity harness of test_parallel_parity.py (tiny GQA GPT, seq_len 32, 3 AdamW steps, clipping far below the
real gradient norm, the shared single-process reference): every cp layout must reproduce the reference losses
within 1e-5, pre-clip gradient norms within 5e-5 relative, the eval loss, and the data consumption (cp ranks of a
group read the same samples). One 2-rank launch runs cp2 ring, cp2 with document masking (against the
single-process document-masked reference), the attention kernel itself (both exchanges against full SDPA, GQA and
MQA K/V exchanged at their own heads, causal and document-masked: values and q/k/v gradients), the negative
control (a ring whose ranks send their K/V chunks swapped must miss the reference loss by far more than the
tolerance), and resumes the cp2 checkpoint it saved under cp2 and dp2; a 1-rank launch resumes it in one
process (cp1). cp2 x FSDP 2 (all-gather exchange, full AC), cp2 x TP+SP 2, cp2 x pp2 and the cp4 kernel run in
test_parallel_parity.py's 4-rank launch (test_two_dimensional_parity,
test_context_parallel_attention_kernel_is_exact_at_cp4).
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest
from distributed.parity_cases import docmask_case
from distributed.test_parallel_parity import STEPS, WQ, _run, assert_parity, placement
from harness import run_ranks

pytestmark = pytest.mark.distributed
CP_WORKER = "distributed.context_parallel_worker:run_cases"
KERNEL_TOL = 1e-5  # fp32 attention values and gradients of unit-normal inputs (measured ~1e-6)
# Each exchange with grouped-query (2 K/V heads) and multi-query (1) K/V, causal and document-masked.
KERNEL_VARIANTS = [f"{e} kv{h}{m}" for e in ("ring", "allgather") for h in (2, 1) for m in ("", " docmask")]


@pytest.fixture(scope="module")
def cp2_checkpoint(tmp_path_factory) -> Path:
    """Where the cp2 ring case saves its state after the STEPS steps (test_cp2_checkpoint_resumes_...)."""
    return tmp_path_factory.mktemp("cp2") / "ckpt"


RESUMED_STEPS = 2  # steps after loading: the second one's loss also depends on the loaded AdamW moments


@pytest.fixture(scope="module")
def two_rank_runs(parity_samples, cp2_checkpoint) -> List[dict]:
    """One 2-rank launch: the kernel check, cp2 ring (saving its checkpoint), cp2 + document masking, the negative
    control, then the cp2 checkpoint resumed under cp2 and under dp2 (DDP, cp1)."""
    resume = {"resume_from": str(cp2_checkpoint), "more": RESUMED_STEPS}
    cases = {
        "kernel": {"kernel": True},
        "cp2_ring": {"overrides": ["parallelism=cp2"], "save_to": str(cp2_checkpoint)},
        "cp2_docmask": docmask_case(["parallelism=cp2"], parity_samples),
        # one step: a wrong exchange is wrong from the first forward on
        "cp2_wrong_exchange": {"overrides": ["parallelism=cp2"], "wrong_exchange": True, "steps": 1},
        "resumed_cp2": {"overrides": ["parallelism=cp2"], **resume},
        "resumed_dp2": {"overrides": ["parallelism=ddp"], **resume},
    }
    return _run(2, cases, parity_samples, timeout=360, worker=CP_WORKER)  # 300 before the resumes joined


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
        assert sorted(out["kernel"]) == sorted(KERNEL_VARIANTS)
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
def test_context_parallel_parity_cp2_document_masking(two_rank_runs, references):
    """cp2 ring with data.document_masking: the document ids and in-document RoPE positions follow each rank's
    two chunks, and every ring block is masked by document; the single-process document-masked losses within
    1e-5. Control: masking changes the losses (the masked reference is not the unmasked one)."""
    assert_parity("cp2_docmask", two_rank_runs, references["docmask"])
    masked, plain = references["docmask"]["losses"], references["untied"]["losses"]
    assert max(abs(a - b) for a, b in zip(masked, plain)) > 1e-3


@pytest.mark.timeout(500)
def test_cp2_checkpoint_resumes_under_cp2_dp2_and_cp1(two_rank_runs, cp2_checkpoint, parity_samples, reference):
    """DCP reshards across cp sizes: the cp2 run's checkpoint (FSDP over cp) loads under cp2, under dp2 (DDP, cp1)
    and in a single process (cp1, no mesh dims at all), and the next two steps' losses are the same in all three,
    after the samples of the STEPS saved steps."""
    assert (cp2_checkpoint / f"step-{STEPS:08d}").is_dir()
    single = run_ranks(
        CP_WORKER,
        1,
        {
            "samples": parity_samples,
            "steps": STEPS,
            "cases": {"resumed_cp1": {"overrides": [], "resume_from": str(cp2_checkpoint), "more": RESUMED_STEPS}},
        },
        timeout=150,
    )
    cp1 = single[0].value["resumed_cp1"]
    assert len(cp1["losses"]) == RESUMED_STEPS
    for out in two_rank_runs:
        for name in ("resumed_cp2", "resumed_dp2"):
            for step, (a, b) in enumerate(zip(out[name]["losses"], cp1["losses"])):
                assert abs(a - b) < 1e-6, f"{name} resumed step {step + 1}: loss {a} vs {b} in one process"
    expected = list(range(STEPS * 8, (STEPS + RESUMED_STEPS) * 8))
    assert sorted(cp1["consumed"]) == expected
    assert sorted(two_rank_runs[0]["resumed_cp2"]["consumed"]) == expected  # cp ranks read the whole step's samples
    assert sorted(i for out in two_rank_runs for i in out["resumed_dp2"]["consumed"]) == expected
    assert cp1["loss"] < reference["losses"][0] - 0.1  # trained weights were loaded, not the initial ones

"""Loss parity of every parallel layout against the single-process run, on real gloo ranks.

Tiny GPT (fp32, seq_len 32), 5 AdamW steps on the same real-text samples, gradient clipping with
``max_norm`` (0.05) far below the real gradient norm (~1), so a gradient norm computed per shard or per
pipeline stage changes both the reported norm and the update. Every layout must reproduce the
single-process losses within 1e-5 (pre-clip gradient norms within 5e-5 relative), consume exactly the same samples (sharded by
the data-parallel rank only) and hold parameters with the expected DTensor placements and shard shapes.
Several layouts share one launch (each builds its own mesh); each launch has its own timeout.
"""
from __future__ import annotations

from typing import Dict, List

import pytest

from harness import run_ranks

STEPS = 5
TOL = 1e-5
# Pre-clip gradient norms agree to ~1e-5 relative (summation order differs per layout); a norm taken per shard
# or per stage is off by tens of percent.
NORM_RTOL = 5e-5
WORKER = "distributed.parallel_worker:run_cases"
pytestmark = pytest.mark.distributed


def _run(world: int, cases: Dict[str, dict], samples, timeout: int) -> List[dict]:
    results = run_ranks(WORKER, world, {"cases": cases, "samples": samples, "steps": STEPS}, timeout=timeout)
    return [r.value for r in results]


@pytest.fixture(scope="module")
def references(parity_samples) -> dict:
    """Single-process runs: untied embeddings (tiny's default) and tied embeddings."""
    return _run(1, {"untied": {"overrides": []}, "tied": {"overrides": ["model.tie_embeddings=true"]}},
                parity_samples, timeout=150)[0]


@pytest.fixture(scope="module")
def reference(references) -> dict:
    return references["untied"]


def assert_parity(name: str, per_rank: List[dict], ref: dict, norm_rtol: float = NORM_RTOL) -> None:
    for out in per_rank:
        r = out[name]
        assert len(r["losses"]) == STEPS
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(a - b) < TOL, f"{name} rank {r['rank']} step {step + 1}: loss {a} vs single {b}"
        for step, (a, b) in enumerate(zip(r["grad_norms"], ref["grad_norms"])):
            assert abs(a - b) < norm_rtol * b, f"{name} rank {r['rank']} step {step + 1}: grad norm {a} vs {b}"
            assert b > 0.05 * 10, "max_norm must be well below the real gradient norm for clipping to bite"
        assert abs(r["eval_loss"] - ref["eval_loss"]) < TOL, f"{name} rank {r['rank']}: eval loss"
    # Identical data consumption: the data-parallel ranks split the single run's samples exactly;
    # ranks with the same data-parallel rank (tp / pp peers) read the same samples.
    by_dp: Dict[int, List[int]] = {}
    for out in per_rank:
        r = out[name]
        if r["dp_rank"] in by_dp:
            assert r["consumed"] == by_dp[r["dp_rank"]], f"{name}: peers of dp rank {r['dp_rank']} read different data"
        by_dp[r["dp_rank"]] = r["consumed"]
    union = sorted(i for seq in by_dp.values() for i in seq)
    assert union == sorted(ref["consumed"]), f"{name}: data-parallel ranks did not split the single run's samples"


def placement(per_rank: List[dict], name: str, param: str, rank: int = 0) -> dict:
    return per_rank[rank][name]["params"][param]


WQ, WO, EMB, NORM, OUT = ("layers.0.attention.wq.weight", "layers.0.attention.wo.weight", "tok_embeddings.weight",
                          "layers.0.attention_norm.weight", "output.weight")


@pytest.fixture(scope="module")
def data_parallel_runs(parity_samples) -> List[dict]:
    cases = {
        "ddp": {"overrides": ["parallelism=ddp"]},
        "ddp_no_overlap": {"overrides": ["parallelism=ddp", "parallelism.overlap_grad_reduce=false"]},
        "fsdp_zero3": {"overrides": ["parallelism=fsdp"]},
        "fsdp_zero2_ac": {"overrides": ["parallelism=fsdp_zero2", "parallelism.activation_checkpointing=full"]},
        "no_grad_sync": {"overrides": ["parallelism=ddp", "parallelism.overlap_grad_reduce=false"], "grad_sync": False},
    }
    return _run(2, cases, parity_samples, timeout=240)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["ddp", "ddp_no_overlap", "fsdp_zero3", "fsdp_zero2_ac"])
def test_data_parallel_parity(data_parallel_runs, reference, case):
    assert_parity(case, data_parallel_runs, reference)
    if case.startswith("fsdp"):
        p = placement(data_parallel_runs, case, WQ)
        assert p["placements"] == ["S(0)"] and p["mesh"] == ["dp_shard"] and p["local"] == [32, 64]
        p = placement(data_parallel_runs, case, EMB, rank=1)
        assert p["placements"] == ["S(0)"] and p["local"] == [4096, 64] and p["global"] == [8192, 64]
    else:
        assert placement(data_parallel_runs, case, WQ) == {"placements": [], "mesh": [], "local": [64, 64],
                                                          "global": [64, 64]}


@pytest.mark.timeout(400)
def test_negative_control_without_gradient_sync_fails_parity(data_parallel_runs, reference):
    """The same harness and data with gradient all-reduce disabled: the parity check must catch it."""
    with pytest.raises(AssertionError, match="loss"):
        assert_parity("no_grad_sync", data_parallel_runs, reference)
    # Each rank stepped on its own half of the batch: the two replicas' losses drift apart.
    r0, r1 = (out["no_grad_sync"] for out in data_parallel_runs)
    assert max(abs(a - b) for a, b in zip(r0["losses"], reference["losses"])) > 1e-4


@pytest.fixture(scope="module")
def tensor_parallel_runs(parity_samples) -> List[dict]:
    cases = {"tp2": {"overrides": ["parallelism=tp2"]},
             "tp2_sp_ac": {"overrides": ["parallelism=tp2_sp", "parallelism.activation_checkpointing=selective"]},
             "tp2_sp_tied": {"overrides": ["parallelism=tp2_sp", "model.tie_embeddings=true"]}}
    return _run(2, cases, parity_samples, timeout=240)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["tp2", "tp2_sp_ac"])
def test_tensor_parallel_parity(tensor_parallel_runs, reference, case):
    runs = tensor_parallel_runs
    assert_parity(case, runs, reference)
    # Column-parallel q (heads split), row-parallel o, vocab-parallel embedding and output.
    assert placement(runs, case, WQ) == {"placements": ["S(0)"], "mesh": ["tp"], "local": [32, 64], "global": [64, 64]}
    assert placement(runs, case, WO, rank=1) == {"placements": ["S(1)"], "mesh": ["tp"], "local": [64, 32],
                                                 "global": [64, 64]}
    assert placement(runs, case, "layers.3.feed_forward.w1.weight")["placements"] == ["S(0)"]
    assert placement(runs, case, "layers.3.feed_forward.w2.weight")["placements"] == ["S(1)"]
    assert placement(runs, case, EMB)["local"] == [4096, 64]
    assert placement(runs, case, OUT)["placements"] == ["S(0)"] and placement(runs, case, OUT)["local"] == [4096, 64]
    # Sequence parallelism turns the norms into replicated DTensors (their inputs are sequence shards).
    expected_norm = ["R"] if case == "tp2_sp_ac" else []
    assert placement(runs, case, NORM)["placements"] == expected_norm


@pytest.mark.timeout(400)
def test_tensor_parallel_with_tied_embeddings_projects_on_the_sharded_table(tensor_parallel_runs, references):
    runs = tensor_parallel_runs
    # Losses within 1e-5 as everywhere; the tied table's gradient (lookup + projection, summed in a different
    # order) lets the norm drift to ~6e-5 relative by step 5, so its norm tolerance is 2e-4 here.
    assert_parity("tp2_sp_tied", runs, references["tied"], norm_rtol=2e-4)
    params = runs[0]["tp2_sp_tied"]["params"]
    assert OUT not in params and params[EMB]["placements"] == ["S(0)"] and params[EMB]["local"] == [4096, 64]


@pytest.fixture(scope="module")
def pipeline_runs(parity_samples) -> List[dict]:
    cases = {"pp2_1f1b_ac": {"overrides": ["parallelism=pp2", "parallelism.activation_checkpointing=full"]},
             "pp2_interleaved": {"overrides": ["parallelism=pp2_interleaved"]},
             "pp2_zero_bubble": {"overrides": ["parallelism=pp2_zb"]},
             "pp2_zbv": {"overrides": ["parallelism=pp2", "parallelism.pp_schedule=ZBVZeroBubble",
                                       "parallelism.pp_virtual_stages=2"]}}
    return _run(2, cases, parity_samples, timeout=240)


# Layers each pipeline rank holds (4 layers): 1 stage per rank, looped virtual stages, V placement.
PP_LAYERS = {"pp2_1f1b_ac": [["0", "1"], ["2", "3"]], "pp2_interleaved": [["0", "2"], ["1", "3"]],
             "pp2_zero_bubble": [["0", "2"], ["1", "3"]], "pp2_zbv": [["0", "3"], ["1", "2"]]}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(PP_LAYERS))
def test_pipeline_parallel_parity(pipeline_runs, reference, case):
    assert_parity(case, pipeline_runs, reference)
    for pp_rank, out in enumerate(pipeline_runs):
        params = out[case]["params"]
        layers = sorted({name.split(".")[1] for name in params if name.startswith("layers.")})
        assert layers == PP_LAYERS[case][pp_rank], f"{case}: pipeline rank {pp_rank} holds layers {layers}"
        holds_last = "3" in layers
        assert (EMB in params) == (pp_rank == 0) and (OUT in params) == holds_last and ("norm.weight" in params) == holds_last


@pytest.fixture(scope="module")
def four_rank_runs(parity_samples) -> List[dict]:
    cases = {"tp2_dp2": {"overrides": ["parallelism=tp2_dp2"]},
             "pp2_dp2_ac": {"overrides": ["parallelism=pp2_dp2", "parallelism.activation_checkpointing=full"]},
             "tp2_pp2": {"overrides": ["parallelism=tp2_pp2"]},
             "hsdp": {"overrides": ["parallelism=hsdp"]}}
    return _run(4, cases, parity_samples, timeout=300)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", ["tp2_dp2", "pp2_dp2_ac", "tp2_pp2", "hsdp"])
def test_two_dimensional_parity(four_rank_runs, reference, case):
    runs = four_rank_runs
    assert_parity(case, runs, reference)
    if case == "tp2_dp2":
        # FSDP over dp_shard on top of TP: dim 0 of q split 4 ways (strided shard over dp, then tp).
        p = placement(runs, case, WQ)
        assert p["mesh"] == ["dp_shard", "tp"] and p["placements"][1] == "S(0)" and p["local"] == [16, 64]
        assert placement(runs, case, NORM)["placements"] == ["S(0)", "R"]
        assert placement(runs, case, NORM)["local"] == [32]
    elif case == "pp2_dp2_ac":
        for out in runs:
            c = out[case]["coords"]
            assert out[case]["params"][f"layers.{2 * c['pp']}.attention.wq.weight"]["local"] == [32, 64]
    elif case == "tp2_pp2":
        for out in runs:
            c = out[case]["coords"]
            assert out[case]["params"][f"layers.{2 * c['pp']}.attention.wq.weight"]["placements"] == ["S(0)"]
    else:  # HSDP: sharded inside a dp_shard group, replicated across dp_replicate groups
        p = placement(runs, case, WQ, rank=3)
        assert p["mesh"] == ["dp_replicate", "dp_shard"] and p["placements"] == ["R", "S(0)"] and p["local"] == [32, 64]

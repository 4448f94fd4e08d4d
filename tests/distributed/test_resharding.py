"""DCP resharding: a checkpoint saved under tensor parallelism (tp=2) loads under data parallelism (dp=2),
under pipeline parallelism (pp=2) and on one process, and the next step's loss is the same everywhere; one saved
under an uneven pipeline split (parallelism.pp_layers) loads under another split and without pipelining.

Model and optimizer state (AdamW moments included) go through CheckpointManager (DCP) with global
parameter names, so any layout can read any other's checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

STEPS = 5
pytestmark = pytest.mark.distributed


@pytest.mark.timeout(500)
def test_tp2_checkpoint_resumes_under_dp2_pp2_and_single_process(parity_samples, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = {"samples": parity_samples, "steps": STEPS}
    saved = run_ranks(
        "distributed.parallel_worker:run_cases",
        2,
        {**args, "cases": {"tp2": {"overrides": ["parallelism=tp2"], "save_to": ckpt}}},
        timeout=200,
    )
    assert (tmp_path / "ckpt" / f"step-{STEPS:08d}").is_dir()
    resumed2 = run_ranks(
        "distributed.parallel_worker:resume_cases",
        2,
        {
            **args,
            "checkpoint": ckpt,
            "cases": {
                "tp2": {"overrides": ["parallelism=tp2"]},
                "dp2": {"overrides": ["parallelism=ddp"]},
                "pp2": {"overrides": ["parallelism=pp2"]},
            },
        },
        timeout=200,
    )
    resumed1 = run_ranks(
        "distributed.parallel_worker:resume_cases",
        1,
        {**args, "checkpoint": ckpt, "cases": {"single": {"overrides": []}}},
        timeout=150,
    )
    same_layout = resumed2[0].value["tp2"]["loss"]
    losses = {name: out["loss"] for r in resumed2 + resumed1 for name, out in r.value.items()}
    for name, loss in losses.items():
        assert abs(loss - same_layout) < 1e-6, (
            f"next-step loss after loading the tp2 checkpoint as {name}: {loss} vs {same_layout}"
        )
    # The step after the checkpoint reads the samples after the 5 saved steps, on every layout.
    expected = list(range(STEPS * 8, STEPS * 8 + 8))
    assert sorted(resumed1[0].value["single"]["consumed"]) == expected
    dp_union = sorted(i for r in resumed2 for i in r.value["dp2"]["consumed"])
    assert dp_union == expected
    # And the loss did change over the saved run: the checkpoint holds trained (not initial) weights.
    first = saved[0].value["tp2"]["losses"][0]
    assert same_layout < first - 0.1


@pytest.mark.timeout(400)
def test_distributed_optimizer_checkpoint_resumes_under_ddp_and_tp2(parity_samples, tmp_path):
    """Saved under the distributed_optimizer preset (FSDP2 dp_shard 2, bf16 gather, fp32 shards): the checkpoint
    holds the fp32 master weights and both AdamW moments under their global names and shapes; loaded under the
    same sharding (fp32 gather), under plain DDP (full replicas) and under tp=2 (no FSDP), the next step's loss is
    the same (1e-6) and the next samples are read. One launch: the save case, then the resumes."""
    from lmforge.checkpoint.safe_io import tensor_metadata

    ckpt = str(tmp_path / "ckpt")
    steps = 3
    layouts = {
        "distopt_fp32": ["parallelism=distributed_optimizer", "parallelism.param_dtype=fp32"],
        "ddp": ["parallelism=ddp"],
        "tp2": ["parallelism=tp2"],
    }
    cases = {
        "distopt": {"overrides": ["parallelism=distributed_optimizer"], "save_to": ckpt},
        "resumed": {
            "call": "distributed.expert_parallel_worker:resume_across_ep",
            "args": {"layouts": layouts, "samples": parity_samples, "steps": steps, "checkpoint": ckpt},
        },
    }
    runs = run_ranks(
        "distributed.parallel_worker:run_cases",
        2,
        {"samples": parity_samples, "steps": steps, "cases": cases},
        timeout=360,
    )
    meta = tensor_metadata(tmp_path / "ckpt" / f"step-{steps:08d}")
    wq = "layers.0.attention.wq.weight"
    for key in (f"model.{wq}", f"optim.state.{wq}.exp_avg", f"optim.state.{wq}.exp_avg_sq"):
        assert key in meta, sorted(k for k in meta if wq in k)
        assert meta[key].properties.dtype == torch.float32 and list(meta[key].size) == [64, 64], key
    assert runs[0].value["distopt"]["param_dtypes"] == ["torch.float32"]
    resumed = [r.value["resumed"] for r in runs]
    same = resumed[0]["distopt_fp32"]["loss"]
    for r in resumed:
        for name, out in r.items():
            assert abs(out["loss"] - same) < 1e-6, f"next-step loss resumed as {name}: {out['loss']} vs {same}"
    expected = list(range(steps * 8, steps * 8 + 8))
    for name in layouts:
        consumed = sorted(i for r in resumed for i in r[name]["consumed"])
        # dp layouts split the step's samples; tp peers read the same ones
        assert sorted(set(consumed)) == expected and len(consumed) == 8 * (2 if name == "tp2" else 1), name
    assert same < runs[0].value["distopt"]["losses"][0] - 1e-3  # trained weights were loaded, not the initial ones


FIVE_LAYERS = ["model.n_layers=5"]  # no even split over 2 stages: the stage map decides
UNEVEN_STEPS = 3


def uneven(*overrides: str) -> dict:
    return {"overrides": FIVE_LAYERS + list(overrides)}


@pytest.mark.timeout(420)
def test_uneven_pipeline_checkpoint_resumes_under_another_split_and_without_pipelining(parity_samples, tmp_path):
    """Saved under pp_layers=[2,3] (rank 1 holds layers 2-4), resumed under [2,3], [3,2] (layer 2 moves to rank 0)
    and dp=2 (no pipeline): the same next-step loss and gradient norm, the next samples read."""
    ckpt = str(tmp_path / "ckpt")
    args = {"samples": parity_samples, "steps": UNEVEN_STEPS}
    save = {**uneven("parallelism=pp2", "parallelism.pp_layers=[2,3]"), "save_to": ckpt}
    saved = run_ranks("distributed.parallel_worker:run_cases", 2, {**args, "cases": {"pp2_2_3": save}}, timeout=150)
    assert (tmp_path / "ckpt" / f"step-{UNEVEN_STEPS:08d}").is_dir()
    cases = {
        "pp2_2_3": uneven("parallelism=pp2", "parallelism.pp_layers=[2,3]"),
        "pp2_3_2": uneven("parallelism=pp2", "parallelism.pp_layers=[3,2]"),
        "dp2": uneven("parallelism=ddp"),
    }
    resumed = run_ranks(
        "distributed.parallel_worker:resume_cases", 2, {**args, "checkpoint": ckpt, "cases": cases}, timeout=200
    )
    same = resumed[0].value["pp2_2_3"]
    for r in resumed:
        for name, out in r.value.items():
            assert abs(out["loss"] - same["loss"]) < 1e-6, f"{name}: next-step loss {out['loss']} vs {same['loss']}"
            assert abs(out["grad_norm"] - same["grad_norm"]) < 5e-5 * same["grad_norm"], f"{name}: grad norm"
    expected = list(range(UNEVEN_STEPS * 8, UNEVEN_STEPS * 8 + 8))
    assert sorted(resumed[0].value["pp2_3_2"]["consumed"]) == expected
    assert sorted(i for r in resumed for i in r.value["dp2"]["consumed"]) == expected
    assert same["loss"] < saved[0].value["pp2_2_3"]["losses"][0] - 0.1  # trained weights, not the initial ones

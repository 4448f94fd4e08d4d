"""DCP resharding: a checkpoint saved under tensor parallelism (tp=2) loads under data parallelism (dp=2),
under pipeline parallelism (pp=2) and on one process, and the next step's loss is the same everywhere.

Model and optimizer state (AdamW moments included) go through CheckpointManager (DCP) with global
parameter names, so any layout can read any other's checkpoint.
"""

from __future__ import annotations

import pytest
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

"""Bigger worlds, same answers: 16 and 32 gloo ranks on one machine (tiny model, the parity harness of
tests/distributed/test_parallel_parity.py with its tolerances), and checkpoints resharded 16 -> 8 -> 4 -> 1 and
1 -> 16.

- 16 ranks, one launch: dp2 x tp2 (+SP) x pp2 x cp2 (a 4-D mesh) and MoE ep4 x tp2 x FSDP dp_shard 8, each equal
  to one process (the MoE case at its micro batch of one sample); the 4-D run saves its checkpoint after 3 steps, and the same launch loads the one-process
  checkpoint of step 3 as dp2 x tp2 x pp2 x cp2 and trains step 4.
- The 16-rank checkpoint loads at 8 ranks (pp2 interleaved x FSDP 2 x TP 2), 4 (TP 2 x PP 2) and 1, and each
  trains step 4: its loss equals the uninterrupted one-process run's step 4 within the parity tolerance, and each
  reads the samples of step 4.
- 32 ranks: pp2 x FSDP dp_shard 8 x TP 2 (global batch 16, one sample a rank) trains 2 steps equal to one process
  and writes a checkpoint of 32 shard files.

At 16 and 32 ranks a rank gets a sixteenth of a core or less; each launch has its own timeout sized for that.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from distributed.parity_cases import MOE  # noqa: E402
from distributed.test_parallel_parity import STEPS, TOL, assert_parity  # noqa: E402
from harness import run_ranks  # noqa: E402

WORKER = "distributed.parallel_worker:run_cases"
FOUR_D = [
    "parallelism.pp=2",
    "parallelism.dp_shard=2",
    "parallelism.tp=2",
    "parallelism.sequence_parallel=true",
    "parallelism.cp=2",
]
EP16 = ["parallelism=fsdp", "parallelism.dp_shard=8", "parallelism.tp=2", "parallelism.ep=4"]
EP16 += ["train.micro_batch_size=1", *MOE]
WIDE32 = ["parallelism.pp=2", "parallelism.dp_shard=8", "parallelism.tp=2"]
BATCH16 = ["train.micro_batch_size=1", "train.global_batch_size=16"]
BATCH = 8  # parallel_worker.BASE's global batch


def values(results) -> list:
    return [r.value for r in results]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("scale-checkpoints")
    return {k: str(root / k) for k in ("one", "sixteen", "thirty_two")}


@pytest.fixture(scope="module")
def one_process(parity_samples, checkpoints) -> dict:
    """One process: the uninterrupted 4-step run, the step-3 checkpoint, and the 32-rank case's reference."""
    cases = {
        "four_steps": {"overrides": [], "steps": STEPS + 1},
        "saved": {"overrides": [], "save_to": checkpoints["one"]},
        "batch16": {"overrides": BATCH16, "steps": 2},
        # the MoE case's reference: one sample a micro batch, as each of its 8 data-parallel ranks holds (expert
        # capacity is counted per micro batch, so the references' two-sample micro batches drop other tokens)
        "moe_micro1": {"overrides": MOE + ["train.micro_batch_size=1"]},
    }
    return run_ranks(WORKER, 1, {"cases": cases, "samples": parity_samples, "steps": STEPS}, timeout=240)[0].value


@pytest.fixture(scope="module")
def sixteen(parity_samples, checkpoints, one_process) -> list:
    resume = {"overrides": FOUR_D, "samples": parity_samples, "steps": STEPS, "checkpoint": checkpoints["one"]}
    cases = {
        "dp2_tp2_pp2_cp2": {"overrides": FOUR_D, "save_to": checkpoints["sixteen"]},
        "moe_ep4_tp2_dp8": {"overrides": EP16},
        "from_one_process": {"call": "distributed.parallel_worker:resume_case", "args": resume},
    }
    return values(run_ranks(WORKER, 16, {"cases": cases, "samples": parity_samples, "steps": STEPS}, timeout=1200))


@pytest.mark.timeout(1800)
def test_sixteen_rank_layouts_equal_one_process(sixteen, references, one_process):
    assert_parity("dp2_tp2_pp2_cp2", sixteen, references["untied"])
    assert_parity("moe_ep4_tp2_dp8", sixteen, one_process["moe_micro1"])
    coords = sorted(
        tuple(out["dp2_tp2_pp2_cp2"]["coords"][d] for d in ("pp", "dp_shard", "cp", "tp")) for out in sixteen
    )
    assert coords == [(p, d, c, t) for p in (0, 1) for d in (0, 1) for c in (0, 1) for t in (0, 1)]


def assert_resumed(name: str, per_rank: list, one: dict) -> None:
    """Step 4 after a load: the uninterrupted run's step-4 loss, and the samples of step 4 read."""
    want = one["four_steps"]["losses"][STEPS]
    for out in per_rank:
        assert abs(out[name]["loss"] - want) < TOL, f"{name}: step-4 loss {out[name]['loss']} vs uninterrupted {want}"
    read = sorted({i for out in per_rank for i in out[name]["consumed"]})
    assert read == list(range(STEPS * BATCH, (STEPS + 1) * BATCH)), f"{name}: read samples {read}"


@pytest.mark.timeout(1800)
def test_one_process_checkpoint_loads_at_sixteen_ranks(sixteen, one_process):
    assert_resumed("from_one_process", sixteen, one_process)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "world,layout", [(8, ["parallelism=3d"]), (4, ["parallelism=tp2_pp2"]), (1, [])], ids=["8", "4", "1"]
)
def test_sixteen_rank_checkpoint_loads_at_fewer_ranks(sixteen, one_process, checkpoints, parity_samples, world, layout):
    args = {
        "samples": parity_samples,
        "steps": STEPS,
        "checkpoint": checkpoints["sixteen"],
        "cases": {"resumed": {"overrides": layout}},
    }
    resumed = values(run_ranks("distributed.parallel_worker:resume_cases", world, args, timeout=600))
    assert_resumed("resumed", resumed, one_process)


@pytest.mark.timeout(1800)
def test_thirty_two_ranks_train_equal_to_one_process_and_checkpoint(parity_samples, checkpoints, one_process):
    cases = {"dp8_tp2_pp2": {"overrides": WIDE32 + BATCH16, "steps": 2, "save_to": checkpoints["thirty_two"]}}
    runs = values(run_ranks(WORKER, 32, {"cases": cases, "samples": parity_samples, "steps": 2}, timeout=1500))
    want = one_process["batch16"]["losses"]
    for out in runs:
        got = out["dp8_tp2_pp2"]["losses"]
        assert len(got) == 2 and all(abs(a - b) < TOL for a, b in zip(got, want)), (got, want)
    shards = list(Path(checkpoints["thirty_two"]).glob("step-00000002/*.distcp"))
    assert len(shards) == 32, sorted(p.name for p in shards)
    assert (Path(checkpoints["thirty_two"]) / "step-00000002" / ".metadata").exists()

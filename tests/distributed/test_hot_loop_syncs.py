"""The training loop makes no host sync between logging steps (what would stall a GPU), in one process and
in 2 real ranks, with the loss guard on and gradient clipping active; and skipping a step through the
fused optimizer's ``found_inf`` leaves weights and optimizer state bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import run_ranks
from sync_probe import syncs_per_step

MAX_STEPS = 8  # logs after steps 1 and 8 only (logging.every_steps=100)
QUIET = {str(s) for s in range(2, MAX_STEPS)}  # compute of steps 3..8 and bookkeeping of steps 2..7


def overrides(tmp_path, name, extra=()):
    base = [
        "model=tiny",
        "model.seq_len=32",
        "train.device=cpu",
        "train.threads=1",
        f"train.max_steps={MAX_STEPS}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_every=0",
        "logging.every_steps=100",
        "logging.console=none",
        "checkpoint.enabled=false",
        "optim.fused=true",
        "optim.grad_clip=0.5",
        "fault.loss_guard=true",
        "fault.spike_factor=3.0",
        "~data.sources.code",
        "~data.sources.reference",
        f"run.root={tmp_path}",
        f"run.name={name}",
    ]
    keys = {e.split("=")[0] for e in extra}
    return [o for o in base if o.split("=")[0] not in keys] + list(extra)


def quiet_steps(result, quiet):
    return {s: n for s, n in result["counts"].items() if s in quiet}


def assert_quiet(result):
    busy = quiet_steps(result, QUIET)
    assert not busy, f"host syncs between logging steps: {busy}; first at {result['where']}"
    assert set(result["counts"]) <= {"0", "1", str(MAX_STEPS)}  # setup, the two logging steps


@pytest.mark.timeout(240)
def test_single_process_steps_make_no_host_sync(tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("LMFORGE_DATA_CACHE", str(data_cache))
    result = syncs_per_step(overrides(tmp_path, "one"), str(tmp_path / "one"))
    assert_quiet(result)
    assert result["counts"].get("1", 0) > 0  # the probe does see the logging step's reads: it can fail


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp2", "pp2", "ddp+async_ckpt", "fsdp+deferred"])
def test_two_rank_steps_make_no_host_sync(tmp_path, data_cache, layout):
    extra = [f"parallelism={layout.split('+')[0]}", "comm=cpu_gloo"]
    quiet = QUIET
    if layout.endswith("async_ckpt"):  # saves after steps 3 and 6, their commits polled while training goes on
        extra += [
            "checkpoint.enabled=true",
            "checkpoint.async_mode=thread",
            "checkpoint.every_steps=3",
            "checkpoint.save_final=false",
        ]
        quiet = QUIET - {"3", "6"}  # the save itself stages tensors; the polls after it must not stall
    if layout.endswith("deferred"):  # 2 micro batches per step, FSDP's reduce-scatter only after the last one
        extra += ["parallelism.fsdp_grad_sync=last_microbatch", "train.micro_batch_size=1"]
    ranks = run_ranks(
        "sync_probe:syncs_per_step",
        2,
        {"overrides": overrides(tmp_path, layout, extra), "run_dir": str(tmp_path / layout)},
        timeout=240,
        env={"LMFORGE_DATA_CACHE": str(data_cache)},
    )
    for r in ranks:
        busy = quiet_steps(r.value, quiet)
        assert not busy, f"rank {r.rank}: host syncs between logging steps: {busy}; first at {r.value['where']}"


@pytest.mark.parametrize("fused", [True, False])
def test_guard_skip_leaves_weights_and_optimizer_state_bit_identical(fused):
    from lmforge.fault.loss_guard import LossGuard
    from lmforge.parallel.native_engine import optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True}))
    guard = LossGuard(max_consecutive=3)
    for step, bad in enumerate([False, False, True, False]):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"]))
        guard.step = step + 1
        skip = guard.skip_tensor(loss.detach() * (float("nan") if bad else 1.0), torch.tensor(1.0))
        optimizer_step(opt, skip)
        opt.zero_grad(set_to_none=True)
        after = (model.state_dict(), opt.state_dict()["state"])
        unchanged = all(torch.equal(before[0][k], v) for k, v in after[0].items()) and all(
            torch.equal(before[1][i][k], after[1][i][k]) for i in after[1] for k in after[1][i]
        )
        assert unchanged == bad, (step, bad)
    verdicts = guard.resolve(force=True)
    assert [v.skipped for v in verdicts] == [False, False, True, False]
    assert verdicts[2].step == 3 and verdicts[2].cause.startswith("non-finite loss (nan)")
    assert guard.skipped_total == 1 and guard.consecutive == 0


@pytest.mark.timeout(120)
def test_stop_vote_stops_every_rank_at_the_same_step_one_after_the_first_signal():
    ranks = run_ranks("distributed.fault_ranks:stop_vote", 3, {"flag_steps": {"1": 5, "2": 9}}, timeout=90)
    assert [r.value["stop_step"] for r in ranks] == [6, 6, 6]
    ranks = run_ranks("distributed.fault_ranks:stop_vote", 2, {"flag_steps": {}}, timeout=90)
    assert [r.value["stop_step"] for r in ranks] == [None, None]

"""A batch ramp (train.batch_size_schedule) with a sequence-length warmup (train.seq_len_schedule) walks the same
samples, cut the same way, with the same LR per step at DP 1, 2 and 4, and a run stopped mid-ramp resumes bit for
bit, also at another data-parallel size.

Trainings through the real entry point (gloo, tiny model, micro batch 1, global batch 16, ramp 4 -> 16 by 4 over
48 samples, train.max_steps=4 full batches = 64 samples): the ramp's steps take 4, 4, 4, 4, 8, 8, 12, 12, 16
samples, nine optimizer steps (72 samples: the last step is whole); the warmup (start 8, over 48 samples) cuts every
32-token sample into 4 pieces before 24 samples and 2 before 48, so steps 1-5 train length 8, steps 6-8 length 16,
step 9 length 32. Two ranks train ``dp2`` uninterrupted, then ``split``: the same run stopped at step 6 (mid-ramp and
mid-stage, 32 samples in) and resumed. Four ranks train ``dp4``. One rank trains ``dp1`` and ``moved``, a DP-1 run
that starts from split's step-6 checkpoint.
"""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

from lmforge.config.batch_ramp import BatchRamp
from lmforge.config.optim import OptimConfig
from lmforge.optim.schedule import lr_multiplier, lr_multiplier_at

pytestmark = pytest.mark.distributed

SEQ, GLOBAL, FULL_STEPS, STOP = 32, 16, 4, 6
RAMP = BatchRamp(start=4, increment=4, ramp_samples=48, global_batch=GLOBAL)
LR, WARMUP = 1e-3, 2
LENGTHS = {1: 8, 2: 8, 3: 8, 4: 8, 5: 8, 6: 16, 7: 16, 8: 16, 9: 32}  # step -> sequence length
TOLERANCE = 1e-5  # relative: fp32 gradients of the same samples reduced in another order


def argv(root, name, dp, *extra):
    return [
        "model=tiny",
        f"model.seq_len={SEQ}",
        "parallelism=ddp",
        f"parallelism.dp_replicate={dp}",
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.threads=1",
        f"train.max_steps={FULL_STEPS}",
        "train.micro_batch_size=1",
        f"train.global_batch_size={GLOBAL}",
        f"train.batch_size_schedule.start={RAMP.start}",
        f"train.batch_size_schedule.increment={RAMP.increment}",
        f"train.batch_size_schedule.ramp_samples={RAMP.ramp_samples}",
        "train.seq_len_schedule.start=8",
        "train.seq_len_schedule.warmup_samples=48",
        f"optim.lr={LR}",
        f"optim.warmup_steps={WARMUP}",
        "train.eval_every=0",
        "logging.every_steps=1",
        "checkpoint.every_steps=0",
        f"checkpoint.at_steps=[{STOP}]",
        "metrics.straggler_every=0",
        "~data.sources.code",
        "~data.sources.reference",
        f"run.root={root}",
        f"run.name={name}",
        *extra,
    ]


def steps(run_dir) -> dict:
    """step -> its train record (a step logged twice keeps its last)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines)) if r.get("kind") == "train"}


def events(run_dir, name: str) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("event") == name]


def resumes(run_dir) -> list:
    return [(r["step"], r["path"]) for r in events(run_dir, "resume")]


def expected() -> dict:
    """step -> (consumed samples after it, its LR), from the pure schedule (config/batch_ramp.py, optim/schedule.py)."""
    cfg = OptimConfig(lr=LR, warmup_steps=WARMUP)
    out = {}
    for s in range(RAMP.steps_to_reach(FULL_STEPS * GLOBAL)):
        before, after = RAMP.samples_before(s), RAMP.samples_before(s + 1)
        out[s + 1] = (after, LR * lr_multiplier_at(before, after, GLOBAL, cfg, max_steps=FULL_STEPS))
    return out


def walked(run: dict) -> dict:
    return {s: (r["consumed_samples"], r["lr"]) for s, r in run.items()}


def lengths(run: dict) -> dict:
    return {s: r["seq_len"] for s, r in run.items()}


@pytest.mark.timeout(400)
def test_the_ramp_and_the_length_warmup_are_the_same_at_dp1_2_4_and_across_a_mid_ramp_resume(tmp_path, data_cache):
    env = {"LMFORGE_DATA_CACHE": str(data_cache)}
    argvs = [argv(tmp_path, "dp2", 2), argv(tmp_path, "split", 2, f"train.stop_at_step={STOP}")]
    argvs.append(argv(tmp_path, "split", 2))
    run_ranks("distributed.train_entries:train_entries", 2, {"argvs": argvs}, timeout=240, env=env)
    run_ranks("distributed.train_entries:train_entries", 4, {"argvs": [argv(tmp_path, "dp4", 4)]}, timeout=240, env=env)
    checkpoint = tmp_path / "split" / "checkpoints" / f"step-{STOP:08d}"
    argvs = [argv(tmp_path, "dp1", 1), argv(tmp_path, "moved", 1, f"train.resume={checkpoint}")]
    out = run_ranks("distributed.train_entries:train_entries", 1, {"argvs": argvs}, timeout=200, env=env)
    dp1, dp2, dp4, split, moved = (steps(tmp_path / name) for name in ("dp1", "dp2", "dp4", "split", "moved"))
    assert resumes(tmp_path / "split") == resumes(tmp_path / "moved") == [(STOP, str(checkpoint))]

    # the samples and the LR of every step, as the schedule defines them, at both sizes and across the resumes
    want = expected()
    assert [want[s][0] for s in sorted(want)] == [4, 8, 12, 16, 24, 32, 44, 56, 72]
    assert walked(dp1) == walked(dp2) == walked(dp4) == walked(split) == want
    assert walked(moved) == {s: want[s] for s in range(STOP + 1, 10)}
    assert all(r["tokens_seen"] == r["consumed_samples"] * SEQ for r in dp1.values())
    assert lengths(dp1) == lengths(dp2) == lengths(dp4) == lengths(split) == LENGTHS
    assert lengths(moved) == {s: LENGTHS[s] for s in range(STOP + 1, 10)}
    assert [(e["step"], e["cause"]) for e in events(tmp_path / "dp1", "seq_len")] == [
        (1, "sequence length 8"),
        (6, "sequence length 16"),
        (9, "sequence length 32"),
    ]
    # negative control: by step (no ramp) the LR of the warmup would differ from the samples' LR
    by_step = [LR * lr_multiplier(s - 1, OptimConfig(lr=LR, warmup_steps=WARMUP), FULL_STEPS) for s in sorted(want)]
    assert by_step != [want[s][1] for s in sorted(want)]
    assert "batch ramp: 4 -> 16 sequences by 4 in 3 stages over 48 samples (8 steps)" in out[0].output
    assert "sequence-length warmup: 8, 16, 32 tokens in 3 stages over 48 samples" in out[0].output
    assert "the same command with train.max_steps above 4 (" in out[0].output  # full batches, not the 9 steps

    # the same samples: DP 1, 2 and 4 losses agree to reduction order; the resumed run is bitwise the uninterrupted
    for s in want:
        for other in (dp1, dp4):
            assert abs(other[s]["loss"] - dp2[s]["loss"]) <= TOLERANCE * abs(dp2[s]["loss"]), (s, other[s], dp2[s])
    for key in ("loss", "grad_norm", "lr", "consumed_samples"):
        assert [split[s][key] for s in want] == [dp2[s][key] for s in want], key
    for s in range(STOP + 1, 10):
        assert abs(moved[s]["loss"] - dp2[s]["loss"]) <= TOLERANCE * abs(dp2[s]["loss"]), (s, moved[s], dp2[s])
    assert len({dp2[s]["loss"] for s in want}) == len(want)  # control: the losses move step by step

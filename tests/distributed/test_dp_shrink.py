"""Elastic data-parallel shrink: a run trained at DP 4 resumes at DP 2 from its last checkpoint, with the same global
batch (twice the gradient accumulation) and the same sample stream, as a requeued job does on fewer nodes.

Three trainings through the real entry point (gloo, tiny model): ``dp4`` trains 8 steps at DP 4 (micro batch 2,
global batch 8: no accumulation) with a checkpoint at step 4; ``shrunk`` is that run directory as a requeue finds it
(the step-8 checkpoint, DONE and the records after step 4 gone) resumed by 2 ranks (``train.resume=auto``: micro
batch 2 x accumulation 2 x DP 2); ``fresh`` is a new dp2 run started from the same step-4 checkpoint
(``train.resume=<checkpoint>``). Steps 5-8 of ``shrunk`` equal ``fresh``'s bit for bit (same ranks, same
arithmetic), and equal the uninterrupted DP-4 run's within parity tolerance (the gradient of the same 8 samples,
summed in another order; other samples would move the loss by orders of magnitude more).
"""

from __future__ import annotations

import json
import shutil

import pytest
from harness import run_ranks

pytestmark = pytest.mark.distributed

STEPS, K = 8, 4
TOLERANCE = 1e-5  # relative: fp32 gradients of the same samples reduced in another order


def argv(root, name, dp, *extra):
    return [
        "model=tiny",
        "model.seq_len=32",
        "parallelism=ddp",
        f"parallelism.dp_replicate={dp}",
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.threads=1",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.eval_every=0",
        "logging.every_steps=1",
        "logging.console=none",
        f"checkpoint.every_steps={K}",
        "checkpoint.keep_last=5",
        "metrics.straggler_every=0",
        "~data.sources.code",
        "~data.sources.reference",
        f"run.root={root}",
        f"run.name={name}",
        *extra,
    ]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def losses(run_dir):
    """step -> loss; a step logged twice keeps its last value."""
    return {r["step"]: r["loss"] for r in records(run_dir) if r.get("kind") == "train"}


def as_a_requeue_finds_it(src, dst):
    """``src`` after its step-K checkpoint: later checkpoints, DONE and the step records after K removed."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > K:
            shutil.rmtree(ckpt)
    (dst / "DONE").unlink()
    kept = [r for r in records(dst) if not (r.get("kind") == "train" and r["step"] > K)]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


@pytest.mark.timeout(600)
def test_dp4_run_resumed_at_dp2_equals_a_dp2_run_from_the_same_checkpoint(tmp_path, data_cache):
    env = {"LMFORGE_DATA_CACHE": str(data_cache)}
    run_ranks("distributed.train_entries:train_entries", 4, {"argvs": [argv(tmp_path, "dp4", 4)]}, timeout=300, env=env)
    dp4 = tmp_path / "dp4"
    assert (dp4 / "checkpoints" / f"step-{K:08d}" / "COMPLETE").exists()
    as_a_requeue_finds_it(dp4, tmp_path / "shrunk")
    checkpoint = dp4 / "checkpoints" / f"step-{K:08d}"
    ranks = run_ranks(
        "distributed.train_entries:train_entries",
        2,
        {"argvs": [argv(tmp_path, "shrunk", 2), argv(tmp_path, "fresh", 2, f"train.resume={checkpoint}")]},
        timeout=300,
        env=env,
    )
    for name, source in (("shrunk", tmp_path / "shrunk"), ("fresh", dp4)):
        resumes = [(r["step"], r["path"]) for r in records(tmp_path / name) if r.get("event") == "resume"]
        assert resumes == [(K, str(source / "checkpoints" / f"step-{K:08d}"))], (name, resumes, ranks[0].output[-3000:])
    reference, shrunk, fresh = losses(dp4), losses(tmp_path / "shrunk"), losses(tmp_path / "fresh")
    after = list(range(K + 1, STEPS + 1))
    assert sorted(fresh) == after and all(s in shrunk for s in after), (sorted(shrunk), sorted(fresh))
    assert [shrunk[s] for s in after] == [fresh[s] for s in after]  # bitwise: the same DP 2 arithmetic
    for s in after:
        assert abs(shrunk[s] - reference[s]) <= TOLERANCE * abs(reference[s]), (s, shrunk[s], reference[s])
    assert reference[STEPS] < reference[1] and len({reference[s] for s in after}) == len(after)  # moving losses

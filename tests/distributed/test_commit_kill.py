"""SIGKILL the checkpoint writer at each stage of the commit protocol: the last complete checkpoint loads and
training resumes bit-identically to an uninterrupted run.

Every run is a real process calling the real entry point (``lmforge.train.main``), forked from one
``multiprocessing`` forkserver that imported lmforge and torch once (a fresh interpreter per run would spend
most of the test importing). The stage hook is installed by the test's own target function through
``checkpoint.fault_injection.install_commit_hook``, never by configuration: at the chosen stage of the commit
of step 4 the writer sends itself SIGKILL.

- ``ref``: 6 steps straight, checkpoints at 2, 4 and 6 (fp32, deterministic): the reference losses.
- each case: a run directory seeded with ``ref``'s step-2 (and, for a re-save, its step-4) resumes from
  step 2 (an absolute ``train.resume``), trains steps 3 and 4 and is killed while committing step 4; a second
  run resumes with ``train.resume=auto`` and finishes. Its losses must equal ``ref``'s for every step it ran.

The stages after the rename-in, a first save killed before its rename, and the negative control (the old
delete-then-rename protocol loses the step) run in one process in tests/unit/test_checkpoint_commit.py.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
from pathlib import Path

import pytest

ARGS = [
    "model=tiny",
    "train.max_steps=6",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "train.deterministic=true",
    "train.precision=fp32",
    "train.device=cpu",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=5",
]
KILL_STEP = 4
# (case id, stage to kill at, whether step-4 already exists (a re-save), async mode, step the resume loads,
#  the checkpoints directory right after the kill: name -> "complete" | "partial")
CASES = [
    (
        "resave-shards",
        "shards",
        True,
        "none",
        4,
        {"step-00000002": "complete", "step-00000004": "complete", ".tmp-step-00000004": "partial"},
    ),
    (
        "resave-sidecar",
        "sidecar",
        True,
        "thread",
        4,
        {"step-00000002": "complete", "step-00000004": "complete", ".tmp-step-00000004": "partial"},
    ),
    (
        "resave-complete",
        "complete",
        True,
        "none",
        4,
        {"step-00000002": "complete", "step-00000004": "complete", ".tmp-step-00000004": "complete"},
    ),
    (
        "resave-between-renames",
        "aside",
        True,
        "thread",
        4,  # step-4 is absent: its aside copy is resolved
        {"step-00000002": "complete", ".old-step-00000004": "complete", ".tmp-step-00000004": "complete"},
    ),
]


def _run(argv, log: str, kill_stage=None) -> None:
    """Forkserver target: one training run through the real entry point, output into ``log``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if kill_stage is not None:
        from lmforge.checkpoint import fault_injection

        def kill_at(stage: str, step: int, final: Path) -> None:
            if stage == kill_stage and step == KILL_STEP:
                print(f"killing the writer after stage {stage} of step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        fault_injection.install_commit_hook(kill_at)
    from lmforge.train import main

    raise SystemExit(main(argv))


def _launch(ctx, root: Path, name: str, extra, kill_stage=None, timeout: float = 240) -> int:
    log = root / f"{name}.log"
    argv = [f"run.root={root}", f"run.name={name}", *ARGS, *extra]
    proc = ctx.Process(target=_run, args=(argv, str(log), kill_stage))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"{name} did not finish in {timeout}s:\n{log.read_text()[-3000:]}")
    return proc.exitcode


def _state(ckpts: Path) -> dict:
    return {
        p.name: "complete" if (p / "COMPLETE").is_file() and (p / "state.json").is_file() else "partial"
        for p in ckpts.iterdir()
    }


def _records(run: Path, kind: str, field: str = "kind"):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get(field) == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("commit-kill")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lmforge.train", "lmforge.trainer.trainer"])
    assert _launch(ctx, root, "ref", []) == 0, (root / "ref.log").read_text()[-3000:]
    out = {}
    for case, stage, resave, mode, _, _ in CASES:
        ckpts = root / case / "checkpoints"
        ckpts.mkdir(parents=True)
        for step in (2, 4) if resave else (2,):
            shutil.copytree(root / "ref" / "checkpoints" / f"step-{step:08d}", ckpts / f"step-{step:08d}")
        resume = f"train.resume={ckpts / 'step-00000002'}"
        killed = _launch(ctx, root, case, [resume, f"checkpoint.async_mode={mode}"], kill_stage=stage)
        after_kill = _state(ckpts)
        resumed = _launch(ctx, root, case, ["train.resume=auto", f"checkpoint.async_mode={mode}"])
        out[case] = {"killed": killed, "after_kill": after_kill, "resumed": resumed, "final": _state(ckpts)}
    return root, out


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case,stage,resave,mode,loads,after_kill", CASES, ids=[c[0] for c in CASES])
def test_kill_at_commit_stage_resumes_bit_identically(runs, case, stage, resave, mode, loads, after_kill):
    root, out = runs
    got = out[case]
    log = (root / f"{case}.log").read_text()
    assert got["killed"] == -signal.SIGKILL, log[-3000:]
    assert f"killing the writer after stage {stage} of step {KILL_STEP}" in log
    assert got["after_kill"] == after_kill
    assert got["resumed"] == 0, log[-3000:]
    assert [e["step"] for e in _records(root / case, "resume", "event")] == [2, loads]  # explicit, then auto
    ref = {r["step"]: r for r in _records(root / "ref", "train")}
    train = _records(root / case, "train")
    steps = [r["step"] for r in train]
    resumed_steps = list(range(loads + 1, 7))
    assert steps[:2] == [3, 4] and steps[-len(resumed_steps) :] == resumed_steps, steps
    if mode == "none":  # a blocking save commits step 4 before step 5 runs
        assert steps == [3, 4, *resumed_steps]
    else:  # an async commit runs at a later step's poll (or the final save): the killed run may have logged 5 or 6
        assert steps[: -len(resumed_steps)] in ([3, 4], [3, 4, 5], [3, 4, 5, 6]), steps
    keys = ("loss", "grad_norm", "lr", "consumed_samples", "tokens_seen")
    for r in train:
        assert {k: r[k] for k in keys} == {k: ref[r["step"]][k] for k in keys}, r["step"]
    # The finished run committed every step; nothing temporary or aside is left behind.
    assert got["final"] == {f"step-{s:08d}": "complete" for s in (2, 4, 6)}
    assert (root / case / "DONE").exists()

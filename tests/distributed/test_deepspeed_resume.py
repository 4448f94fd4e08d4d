"""DeepSpeed checkpoints through the platform's policy, via the real entry point (``python -m lmforge.train``).

Run A: ZeRO-3 on 2 gloo ranks trains 6 steps, checkpointing at 3 and 6. Then, side by side:
- B (2 ranks) starts from A's step-3 checkpoint alone (resume=auto): steps 4-6 must be bit-identical to A's
  (model, optimizer partitions, RNG, data position and LR schedule restored).
- C (1 rank, dp_replicate=1) resumes the same 2-rank checkpoint: the data-parallel size changed, so the
  checkpoint goes through DeepSpeed's universal layout.
- D: ``lmforge ckpt convert --to native`` turns it into a DCP checkpoint and the native engine (1 process)
  continues: its next-step loss equals A's, and its later steps too (optimizer state converted).
- E (2 ranks, ZeRO-3) continues from that *native* checkpoint: the way back, DCP -> ZeRO partitions.
Each launch is judged by what it wrote (metrics.jsonl, checkpoints, DONE); a launch that finished all of that
may still exit with the ZeRO-3 teardown abort, which is accepted only with its exact signature.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

N = 6
COMMON = [
    "model=tiny",
    f"train.max_steps={N}",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.threads=1",
    "train.deterministic=true",
    "train.precision=fp32",
    "train.device=cpu",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.every_steps=3",
    "checkpoint.keep_last=5",
]
EXIT_ABORT = "terminate called without an active exception"


def start(root: Path, name: str, world: int, extra) -> list:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LMFORGE_RUN_ID": name,
            "DS_ACCELERATOR": "cpu",
        }
        log = open(root / f"{name}-rank{rank}.log", "w")
        cmd = [sys.executable, "-m", "lmforge.train", f"run.root={root}", f"run.name={name}", *COMMON, *extra]
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(root: Path, name: str, procs, timeout: float = 400) -> None:
    """Wait; accept exit 0, or the known teardown abort after the run wrote DONE and its last checkpoint."""
    for p in procs:
        p.wait(timeout=timeout)
    for rank, p in enumerate(procs):
        out = (root / f"{name}-rank{rank}.log").read_text(errors="replace")
        finished = (root / name / "DONE").exists()
        assert p.returncode == 0 or (finished and EXIT_ABORT in out), (
            f"{name} rank {rank} exit {p.returncode}\n{out[-4000:]}"
        )


def train_records(run: Path, kind: str = "train"):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def eval_losses(run: Path) -> dict:
    return {r["step"]: {k: v for k, v in r.items() if k.endswith("/loss")} for r in train_records(run, "eval")}


def events(run: Path, name: str):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("event") == name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("ds-resume")
    finish(root, "A", start(root, "A", 2, ["parallelism=zero3"]))
    step3 = root / "A" / "checkpoints" / "step-00000003"
    for name in ("B", "C"):
        shutil.copytree(step3, root / name / "checkpoints" / step3.name)
    b = start(root, "B", 2, ["parallelism=zero3"])
    c = start(root, "C", 1, ["parallelism=zero3", "parallelism.dp_replicate=1"])
    conv = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "ckpt",
            "convert",
            str(step3),
            str(root / "D" / "checkpoints"),
            "--to",
            "native",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    shutil.copytree(root / "D" / "checkpoints" / step3.name, root / "E" / "checkpoints" / step3.name)
    d = start(root, "D", 1, ["parallelism=single"])
    e = start(root, "E", 2, ["parallelism=zero3"])
    for name, procs in (("B", b), ("C", c), ("D", d), ("E", e)):
        finish(root, name, procs)
    return root


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_zero3_checkpoint_is_a_platform_checkpoint(runs):
    ckpts = runs / "A" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000003", "step-00000006"]  # committed, no .tmp left
    step3 = ckpts / "step-00000003"
    side = json.loads((step3 / "state.json").read_text())
    assert (step3 / "COMPLETE").read_text() == "3"
    assert side["format"] == "deepspeed" and side["zero_stage"] == 3 and side["dp_size"] == 2
    assert side["world_size"] == 2 and side["data"]["consumed_samples"] == 24 and side["scheduler"]["step"] == 3
    files = sorted(p.name for p in (step3 / "deepspeed").iterdir())
    assert files == [f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")]
    assert sorted(p.name for p in step3.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # per-rank RNG
    assert (runs / "A" / "DONE").exists()


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_stage3_resume_is_bit_identical(runs):
    a, b = train_records(runs / "A"), train_records(runs / "B")
    assert [r["step"] for r in b] == [4, 5, 6] and [e["step"] for e in events(runs / "B", "resume")] == [3]
    keys = ("loss", "grad_norm", "lr", "consumed_samples", "tokens_seen", "tokens/books", "tokens/code")
    for ra, rb in zip(a[3:], b):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}, ra["step"]
    assert eval_losses(runs / "A")[6] == eval_losses(runs / "B")[6] and len(eval_losses(runs / "A")[6]) == 3


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_resume_with_a_different_dp_size(runs):
    a, c = train_records(runs / "A"), train_records(runs / "C")
    assert [r["step"] for r in c] == [4, 5, 6] and [e["step"] for e in events(runs / "C", "resume")] == [3]
    assert c[0]["consumed_samples"] == a[3]["consumed_samples"] and c[0]["lr"] == a[3]["lr"]
    for ra, rc in zip(a[3:], c):  # 1 rank x 2 micro batches instead of 2 ranks x 1: only summation order differs
        assert (
            abs(ra["loss"] - rc["loss"]) < 1e-5 and abs(ra["grad_norm"] - rc["grad_norm"]) < 1e-4 * ra["grad_norm"]
        ), (ra, rc)
    assert not list((runs / "C" / "checkpoints").glob(".universal-*"))  # the temporary conversion is removed
    assert json.loads((runs / "C" / "checkpoints" / "step-00000006" / "state.json").read_text())["dp_size"] == 1


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_deepspeed_to_native_conversion_continues(runs):
    a, d = train_records(runs / "A"), train_records(runs / "D")
    side = json.loads((runs / "D" / "checkpoints" / "step-00000003" / "state.json").read_text())
    assert "format" not in side and side["converted_from"]["zero_stage"] == 3 and side["step"] == 3
    assert [r["step"] for r in d] == [4, 5, 6] and [e["step"] for e in events(runs / "D", "resume")] == [3]
    assert abs(d[0]["loss"] - a[3]["loss"]) < 1e-5  # the same next-step loss
    for ra, rd in zip(a[3:], d):  # and the AdamW moments and step count came along
        assert abs(ra["loss"] - rd["loss"]) < 1e-5, (ra["step"], ra["loss"], rd["loss"])
    # Evaluation means the same across engines: C (DeepSpeed) and D (native) both run on 1 rank, so they
    # evaluate the same held-out samples (the eval set is sharded by data-parallel rank).
    for source, loss in eval_losses(runs / "C")[6].items():
        assert abs(eval_losses(runs / "D")[6][source] - loss) < 1e-5, source
    assert (runs / "D" / "DONE").exists()


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_native_checkpoint_continues_under_deepspeed(runs):
    a, e = train_records(runs / "A"), train_records(runs / "E")
    assert [r["step"] for r in e] == [4, 5, 6] and [ev["step"] for ev in events(runs / "E", "resume")] == [3]
    for ra, re_ in zip(a[3:], e):  # DeepSpeed -> native -> DeepSpeed round trip
        assert abs(ra["loss"] - re_["loss"]) < 1e-5, (ra["step"], ra["loss"], re_["loss"])
    side = json.loads((runs / "E" / "checkpoints" / "step-00000006" / "state.json").read_text())
    assert side["format"] == "deepspeed" and side["zero_stage"] == 3
